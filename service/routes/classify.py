"""POST /v1/classify (JSON or multipart) and /v1/classify/batch: decode -> plan -> run -> encode."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from engines.manifest import Ensemble, Rung, Stage
from engines.thresholds import softmax
from service.deps import ReadyRuntimeDep
from service.errors import ApiError, BadImage, DeadlineExpired, InvalidRequest, UnsupportedMediaType
from service.images import decode_array, decode_base64, decode_bytes, to_input
from service.planner import OnInfeasible, Policy
from service.runtime import Runtime
from service.scheduler import Job
from service.schemas import BatchRequest, BatchResponse, ClassifyOptions, ClassifyRequest, ClassifyResponse, TopK

router = APIRouter(prefix="/v1", tags=["classify"])

_BODY_DOC = {
    "requestBody": {
        "content": {
            "application/json": {"schema": ClassifyRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "deadline_ms"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "deadline_ms": {"type": "number"},
                        "policy": {"type": "string"},
                        "rung": {"type": "string"},
                        "on_infeasible": {"type": "string"},
                        "top_k": {"type": "integer"},
                    },
                }
            },
        },
        "required": True,
    }
}


def _validate(model: type[ClassifyOptions], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"{where}: {first['msg']}" if where else first["msg"]) from None


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("body is not valid JSON") from None


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _decode(image: str | list[Any]) -> Any:
    return decode_base64(image) if isinstance(image, str) else decode_array(image)


async def _parse_single(request: Request) -> tuple[ClassifyOptions, Any]:
    media = _media_type(request)
    if media == "application/json":
        body = _validate(ClassifyRequest, await _read_json(request))
        return body, _decode(body.image)
    if media == "multipart/form-data":
        form = await request.form()
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("file: a multipart request needs the image as a file field named 'file'")
        fields = {k: v for k, v in form.items() if k != "file" and isinstance(v, str)}
        options = _validate(ClassifyOptions, fields)
        return options, decode_bytes(await upload.read())
    raise UnsupportedMediaType(
        f"content type {media or 'none'} is not accepted; send application/json or multipart/form-data"
    )


def _submit(
    runtime: Runtime, x: np.ndarray, options: ClassifyOptions, arrival: float, loop: asyncio.AbstractEventLoop
) -> tuple[Job, asyncio.Future[Job]]:
    deadline = arrival + options.deadline_ms / 1e3
    time_left = (deadline - time.monotonic()) * 1e3
    plan = runtime.planner.plan(
        options.policy, time_left, runtime.scheduler.wait_ms(deadline), options.on_infeasible, options.rung
    )
    future: asyncio.Future[Job] = loop.create_future()

    def resolve(job: Job) -> None:
        if not future.done():
            future.set_result(job)

    def done(job: Job) -> None:  # runs on the worker thread
        loop.call_soon_threadsafe(resolve, job)

    job = Job(uuid.uuid4().hex[:16], arrival, deadline, x, plan, done)
    runtime.scheduler.submit(job)
    return job, future


async def _watch_disconnect(request: Request, jobs: list[Job], runtime: Runtime) -> None:
    """The body is read, so the next message is the client going away: cancel its queued work."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                runtime.scheduler.cancel(job)
            return


async def _await_jobs(request: Request, runtime: Runtime, jobs: list[Job], futures: list[asyncio.Future[Job]]) -> None:
    watcher = asyncio.create_task(_watch_disconnect(request, jobs, runtime))
    try:
        await asyncio.gather(*futures)
    finally:
        watcher.cancel()


def _encode(runtime: Runtime, job: Job, options: ClassifyOptions, resized: bool) -> ClassifyResponse:
    metrics = runtime.metrics
    if job.error is not None:
        metrics.requests.labels(options.policy, job.plan.name, job.error.code).inc()
        raise job.error
    assert job.logits is not None and job.finished is not None and job.started is not None
    probs = softmax(job.logits.astype(np.float64))[0]
    order = np.argsort(-probs)[: options.top_k]
    names = runtime.ladder.class_names
    record = runtime.records[job.plan.engines[job.step - 1]]
    latency = (job.finished - job.arrival) * 1e3
    met = job.finished <= job.deadline
    exit_k = record.index if isinstance(record, Stage) else record.exit if isinstance(record, Rung) else 0
    metrics.latency.observe(latency)
    metrics.queue.observe((job.started - job.arrival) * 1e3)
    if not met:
        metrics.deadline_misses.inc()
        if options.on_infeasible is OnInfeasible.REJECT:  # only a best-effort client takes a late answer
            metrics.requests.labels(options.policy, job.plan.name, DeadlineExpired.code).inc()
            late_ms = round((job.finished - job.deadline) * 1e3, 3)
            raise DeadlineExpired(f"the answer was ready {late_ms} ms after the deadline", late_ms=late_ms)
    metrics.requests.labels(options.policy, job.plan.name, "ok" if met else "late").inc()
    metrics.exits.labels(str(exit_k)).inc()
    return ClassifyResponse(
        request_id=job.id,
        label=int(order[0]),
        class_name=names[int(order[0])],
        top_k=[TopK(label=int(i), class_name=names[int(i)], probability=float(probs[i])) for i in order],
        rung=job.plan.name,
        policy=options.policy,
        exit=int(exit_k),
        precision=str(record.precision),
        backend=str(record.backend),
        members=list(record.members) if isinstance(record, Ensemble) else [],
        entropy=job.entropy,
        stages_run=job.step,
        batch_sizes=job.batch_sizes,
        latency_ms=round(latency, 3),
        queue_ms=round((job.started - job.arrival) * 1e3, 3),
        deadline_ms=options.deadline_ms,
        deadline_met=met,
        resized=resized,
    )


def _count_rejection(runtime: Runtime, options: ClassifyOptions | None, error: ApiError) -> None:
    policy = options.policy if options is not None else "unknown"
    runtime.metrics.requests.labels(policy, options.rung or "" if options else "", error.code).inc()


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    openapi_extra=_BODY_DOC,
    responses={400: {}, 404: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}, 504: {}},
)
async def classify(request: Request, runtime: ReadyRuntimeDep) -> Response:
    """Classify one image within `deadline_ms` of its arrival; says which rung answered and if it was on time."""
    arrival = request.scope["state"]["arrival"]
    options = None
    try:
        options, image = await _parse_single(request)
        if options.policy is not Policy.FIXED and options.rung is not None:
            raise InvalidRequest("rung: only policy=fixed takes a rung")
        x, resized = to_input(image, runtime.spec)
        job, future = _submit(runtime, x, options, arrival, asyncio.get_running_loop())
    except ApiError as e:
        _count_rejection(runtime, options, e)
        raise
    await _await_jobs(request, runtime, [job], [future])
    return _json(_encode(runtime, job, options, resized))


@router.post(
    "/classify/batch",
    response_model=BatchResponse,
    responses={400: {}, 404: {}, 413: {}, 415: {}, 422: {}, 429: {}, 503: {}, 504: {}},
)
async def classify_batch(request: Request, runtime: ReadyRuntimeDep) -> Response:
    """Classify several images under one deadline; each is planned and may be batched with others."""
    arrival = request.scope["state"]["arrival"]
    if _media_type(request) != "application/json":
        raise UnsupportedMediaType("the batch form takes application/json")
    body: BatchRequest = _validate(BatchRequest, await _read_json(request))
    if body.policy is not Policy.FIXED and body.rung is not None:
        raise InvalidRequest("rung: only policy=fixed takes a rung")
    inputs = []
    for i, image in enumerate(body.images):
        try:
            inputs.append(to_input(_decode(image), runtime.spec))
        except BadImage as e:
            raise BadImage(f"images.{i}: {e.message}") from None
    loop = asyncio.get_running_loop()
    jobs, futures = [], []
    try:
        for x, _ in inputs:
            job, future = _submit(runtime, x, body, arrival, loop)
            jobs.append(job)
            futures.append(future)
    except ApiError as e:
        for job in jobs:  # all or nothing: what was queued is withdrawn, and answered by this error
            runtime.scheduler.cancel(job)
        _count_rejection(runtime, body, e)
        raise
    await _await_jobs(request, runtime, jobs, futures)
    return _json(BatchResponse(results=[_encode(runtime, j, body, r) for j, (_, r) in zip(jobs, inputs, strict=True)]))


def _json(body: BaseModel) -> Response:
    """The response, serialized once: returning the model would have FastAPI validate it a second time."""
    return Response(body.model_dump_json(), media_type="application/json")
