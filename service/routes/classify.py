"""POST /v1/classify and /v1/classify/batch: admit, read, parse, plan, decode, run, encode, write, count.

The hot path is kept small and measured (service/timing.py). Work that cannot be done in time is refused
as early as possible: readiness, shutdown and queue room before the body is read; the plan before the
body is read when the options are all in the query string and headers (binary bodies), else right after
parsing and before any image is decoded. A client that leaves is counted and answered with nothing. An
answer's metrics and the planner's feedback on it are counted once it is written (`_account`).

Both routes are plain ASGI apps mounted as Starlette routes of the FastAPI app: measured on this
repository's 2-vCPU machine (uvloop + httptools, one keep-alive client), a FastAPI path operation cost
111 us of server CPU per request against 68 us for the same app with an ASGI route, and 49 us for uvicorn
alone. FastAPI still documents them in OpenAPI (service/routes/docs.py). The app's `FrontDoor` middleware
(service/app.py) hands each POST to them directly, past the router.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engines.base import row_softmax
from engines.manifest import EngineRecord, Ensemble, Rung, Stage
from service.admission import admit, plan_for
from service.errors import (
    ApiError,
    BodyTimeout,
    ClientGone,
    DeadlineExpired,
    ShuttingDown,
)
from service.images import INLINE_MAX_PIXELS, Input
from service.planner import OnInfeasible, Plan, PlanKind
from service.requests import (
    INLINE_MAX_JSON,
    JSON,
    MULTIPART,
    Head,
    open_all,
    parse_binary,
    parse_json,
    parse_multipart,
    read_body,
    validate_options,
)
from service.runtime import Runtime
from service.scheduler import Job
from service.schemas import ClassifyOptions
from service.timing import Clock, PathTime

# Status, JSON body, headers, and the answer's bookkeeping to do once it is sent (or None); None: the client is gone
Answer = tuple[int, bytes, list[tuple[bytes, bytes]], Callable[[], None] | None] | None


class ClassifyApp:
    """The ASGI app of one classify route."""

    def __init__(self, batch: bool) -> None:
        self.batch = batch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime: Runtime = scope["app"].state.runtime
        runtime.in_flight += 1  # the event loop's thread only: a plain count (anytime_requests_in_flight)
        try:
            answer = await _handle(scope, receive, self.batch)
            if answer is None:  # the client left: there is no one to answer
                return
            status, body, headers, account = answer
            head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
            head.append((b"x-request-id", scope["state"]["request_id"].encode()))
            try:
                await send({"type": "http.response.start", "status": status, "headers": head})
                await send({"type": "http.response.body", "body": body})
            finally:
                if account is not None:  # after the answer is written: the client does not wait for it (_account)
                    account()
        finally:
            runtime.in_flight -= 1


routes = [
    Route("/v1/classify", ClassifyApp(batch=False), methods=["POST"]),
    Route("/v1/classify/batch", ClassifyApp(batch=True), methods=["POST"]),
]


class _Waiter:
    """Resolves one future on the event loop when every job of a request is done.

    Jobs finish on the worker thread, or on the event loop itself when they ran inline: then the future
    resolves at once and the request goes on without a round trip through the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop, self.left, self.future = loop, n, loop.create_future()
        self.thread = threading.get_ident()

    def job_done(self, job: Job) -> None:
        if threading.get_ident() == self.thread:
            self._one()
        else:
            self.loop.call_soon_threadsafe(self._one)

    def _one(self) -> None:
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(None)


async def _handle(scope: Scope, receive: Receive, batch: bool) -> Answer:
    runtime: Runtime = scope["app"].state.runtime
    clock = Clock(scope["state"]["arrival"])
    clock.lap("loop", scope["state"]["entered"])
    options: ClassifyOptions | None = None
    jobs: list[Job] = []
    try:
        # Admitted by the HTTP parser already (service/server.py), or here: before the body is read.
        admitted = scope["state"].pop("admitted", None) or admit(runtime, scope, batch, clock.arrival)
        head, options, plan = admitted.head, admitted.options, admitted.plan
        planned, where = clock.arrival, "parser"  # planned with admission, as the request arrived (or below)
        body = await read_body(receive, runtime.settings.max_body_bytes, partial(_body_limit, runtime, options, clock))
        clock.lap("receive")
        fields, items = await _parse(runtime, scope, head, body, batch)
        clock.lap("parse")
        if options is None:
            options = validate_options(head.fields, fields)
        if "loop_lag" in scope["state"]:  # service/server.py: the loop may fall further behind for loose deadlines
            scope["state"]["loop_lag"].served(options.deadline_ms)
        runtime.scheduler.check_room(len(items))
        clock.lap("validate")
        if plan is None:
            plan = plan_for(runtime, options, clock.arrival)
            planned, where = time.monotonic(), "route"
        await runtime.require(plan.engines)  # a dominated rung is loaded on first use
        clock.lap("plan")
        inputs = await _decode(runtime, items, len(body))
        clock.lap("decode")
        waiter = _Waiter(asyncio.get_running_loop(), len(inputs))
        jobs = _submit(runtime, inputs, options, plan, clock, waiter, scope["state"]["request_id"], batch)
    except ApiError as e:
        _count(runtime, options, e.code)
        return _error(e, clock)
    except ClientGone:
        runtime.metrics.disconnects.labels("receive").inc()
        return None
    try:
        await _wait(receive, runtime, jobs, waiter)
    except ClientGone:
        runtime.metrics.disconnects.labels("running" if any(j.started for j in jobs) else "queued").inc()
        return None
    except asyncio.CancelledError:  # the server stops and its drain time is over: answer, do not vanish
        for job in jobs:
            runtime.scheduler.cancel(job)
        return _error(ShuttingDown("the server is shutting down", headers={"Retry-After": "1"}), clock)
    _time_jobs(clock, jobs, runtime.paths[where], planned)
    return _encode(runtime, jobs, [r for _, r in inputs], options, clock, batch)


def _body_limit(runtime: Runtime, options: ClassifyOptions | None, clock: Clock) -> tuple[float, ApiError]:
    """How long the body may take to arrive: the body timeout, or less when the deadline is known and nearer."""
    timeout = runtime.settings.body_timeout_s
    if options is not None and options.deadline_ms / 1e3 < timeout:
        left = clock.arrival + options.deadline_ms / 1e3 - time.monotonic()
        return max(left, 0.0), DeadlineExpired("the deadline passed while the body was still arriving")
    return timeout, BodyTimeout(f"the body did not arrive within {timeout:g} s")


async def _parse(
    runtime: Runtime, scope: Any, head: Head, body: bytes, batch: bool
) -> tuple[dict[str, Any], list[Any]]:
    """Option fields and the images, not yet opened (binary bodies: opened, their options are in the head)."""
    if head.media == JSON:
        if len(body) <= INLINE_MAX_JSON:
            return parse_json(body, batch)
        return await asyncio.get_running_loop().run_in_executor(runtime.decoder, parse_json, body, batch)
    if head.media == MULTIPART:
        return await parse_multipart(scope, body, batch)
    return {}, parse_binary(head, body, batch, runtime.spec)


async def _decode(runtime: Runtime, items: list[Any], body_bytes: int) -> list[Input]:
    """Open and decode: small images on the event loop (< ~0.1 ms), large ones in the decode thread."""
    loop = asyncio.get_running_loop()
    if body_bytes <= INLINE_MAX_JSON:
        pending = open_all(items, runtime.spec)
    else:  # base64-decoding megabytes is not for the event loop
        pending = await loop.run_in_executor(runtime.decoder, open_all, items, runtime.spec)
    if sum(p.pixels for p in pending) <= INLINE_MAX_PIXELS:
        return [p.decode() for p in pending]
    return await loop.run_in_executor(runtime.decoder, lambda: [p.decode() for p in pending])


def _submit(
    runtime: Runtime,
    inputs: list[Input],
    options: ClassifyOptions,
    plan: Plan,
    clock: Clock,
    waiter: _Waiter,
    request_id: str,
    batch: bool,
) -> list[Job]:
    """Queue one job per image: the request's id names it (a batch's images: the id, a dot and the index)."""
    deadline = clock.arrival + options.deadline_ms / 1e3
    best_effort = options.on_infeasible is OnInfeasible.BEST_EFFORT
    jobs: list[Job] = []
    # A quick engine may run on the event loop for a lone image: always for a tight deadline, and for a looser one
    # only while it is the one request in the app; else the worker takes it, batched with others (docs/measurements.md,
    # "Inline by deadline").
    tight = options.deadline_ms <= runtime.settings.inline_max_deadline_ms
    inline = len(inputs) == 1 and (tight or runtime.in_flight == 1)
    try:
        for i, (x, _) in enumerate(inputs):
            if i:  # each further image of a batch is planned with the ones before it in the queue
                plan = plan_for(runtime, options, clock.arrival)
            job_id = f"{request_id}.{i}" if batch else request_id
            job = Job(job_id, clock.arrival, deadline, x, plan, waiter.job_done, best_effort)
            runtime.scheduler.submit(job, inline=inline)
            jobs.append(job)
    except ApiError:
        for job in jobs:  # all or nothing: what was queued is withdrawn, and answered by this error
            runtime.scheduler.cancel(job)
        raise
    return jobs


async def _wait(receive: Receive, runtime: Runtime, jobs: list[Job], waiter: _Waiter) -> None:
    """Wait for the jobs; if the client leaves meanwhile, cancel them (their queue slots free at once)."""
    if waiter.future.done():  # they ran inline
        return

    async def watch() -> None:
        message = await receive()  # the body is read: the next message is the client leaving
        if message["type"] == "http.disconnect" and not waiter.future.done():
            waiter.future.set_exception(ClientGone())  # first: cancelling finishes the jobs, which would resolve it
            for job in jobs:
                runtime.scheduler.cancel(job)

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await waiter.future
    finally:
        watcher.cancel()


def _time_jobs(clock: Clock, jobs: list[Job], path: PathTime, planned: float) -> None:
    """The scheduler's phases, taken from the job that finished last; and the path after the plan, which
    the next plans allow for (service/timing.py: PathTime)."""
    decoded = clock.last
    resumed = clock.lap("handback")
    last = max(jobs, key=lambda j: j.finished or 0.0)
    if last.finished is None or last.submitted is None:
        return
    clock.add("enqueue", (last.submitted - decoded) * 1e3)
    clock.add("queue", ((last.finished - last.submitted) - last.run_s) * 1e3)
    clock.add("run", last.run_s * 1e3)
    clock.add("handback", (resumed - last.finished) * 1e3)
    path.observe((last.submitted - planned + resumed - last.finished) * 1e3)


def _encode(
    runtime: Runtime, jobs: list[Job], resized: list[bool], options: ClassifyOptions, clock: Clock, batch: bool
) -> Answer:
    answers: list[dict[str, Any]] = []
    try:
        for job, r in zip(jobs, resized, strict=True):
            answers.append(_answer(runtime, job, options, r))
    except ApiError as e:  # a batch's images answered before the one that failed still count
        return _error(e, clock, lambda: _account(runtime, jobs, answers, options))
    body = orjson.dumps({"results": answers} if batch else answers[0])
    clock.lap("encode")
    timing = [(b"server-timing", clock.server_timing())]
    return 200, body, timing, lambda: _account(runtime, jobs, answers, options, clock)


def _answer(runtime: Runtime, job: Job, options: ClassifyOptions, resized: bool) -> dict[str, Any]:
    """One job's answer, or its error (raised, and counted at once); an answer is counted by `_account`."""
    metrics = runtime.metrics
    if job.error is not None:
        metrics.outcome(options.policy, job.plan.name, job.error.code).inc()
        raise job.error
    assert job.logits is not None and job.started is not None, "a job without error has an answer"
    now = time.monotonic()
    latency, met = (now - job.arrival) * 1e3, now <= job.deadline
    queue_ms = (job.started - job.arrival) * 1e3
    if not met and not job.best_effort:  # only a best-effort client takes a late answer
        _observe(runtime, job, latency, queue_ms, (job.deadline - now) * 1e3, met)
        metrics.outcome(options.policy, job.plan.name, DeadlineExpired.code).inc()
        late_ms = round((now - job.deadline) * 1e3, 3)
        raise DeadlineExpired(f"the answer was ready {late_ms} ms after the deadline", late_ms=late_ms)
    probs, entropy = row_softmax(job.logits[0].tolist())
    if options.top_k == 1:
        order = [probs.index(max(probs))]
    else:  # stable: of equal probabilities, the lower label first
        order = sorted(range(len(probs)), key=probs.__getitem__, reverse=True)[: options.top_k]
    names = runtime.ladder.class_names
    record = runtime.records[job.plan.engines[job.step - 1]]
    exit_k, members = _exit_and_members(job, record)
    return {
        "request_id": job.id,
        "label": order[0],
        "class_name": names[order[0]],
        "top_k": [{"label": i, "class_name": names[i], "probability": probs[i]} for i in order],
        "rung": job.plan.name,
        "policy": str(options.policy),
        "exit": int(exit_k),
        "precision": str(record.precision),
        "backend": str(record.backend),
        "members": members,
        "entropy": entropy,
        "stages_run": job.step,
        "batch_sizes": job.batch_sizes,
        "latency_ms": round(latency, 3),
        "queue_ms": round(queue_ms, 3),
        "deadline_ms": options.deadline_ms,
        "deadline_met": met,
        "resized": resized,
        "ladder_version": runtime.ladder_version,
    }


def _account(
    runtime: Runtime,
    jobs: list[Job],
    answers: list[dict[str, Any]],
    options: ClassifyOptions,
    clock: Clock | None = None,
) -> None:
    """The served answers' bookkeeping: metrics, and the planner's feedback on how close to its deadline each came.

    Called once the answer is written, so that the client does not wait for it. Side by side at concurrency 1 (the code
    before and after, one server each, fixed exit 1 INT8, six runs; docs/measurements.md, "Answer first, count after"):
    the client's time beyond the answer's `latency_ms` was 0.003-0.058 ms less at the median in all 12 comparisons (JSON
    and PNG bodies). The event loop does it before it reads another request, so /metrics and the next plan see it as
    before."""
    metrics = runtime.metrics
    for job, answer in zip(jobs, answers, strict=False):  # strict=False: a failed batch's answers stop short
        met = answer["deadline_met"]
        slack_ms = answer["deadline_ms"] - answer["latency_ms"]
        _observe(runtime, job, answer["latency_ms"], answer["queue_ms"], slack_ms, met)
        metrics.outcome(options.policy, job.plan.name, "ok" if met else "late").inc()
        metrics.exit(answer["exit"]).inc()
    if clock is not None:
        metrics.phases.observe(clock.ms)


def _observe(runtime: Runtime, job: Job, latency_ms: float, queue_ms: float, slack_ms: float, met: bool) -> None:
    """An answer that was ready (on time or not): its latency, its queueing, a miss, and the planner's feedback."""
    runtime.metrics.latency.observe(latency_ms)
    runtime.metrics.queue.observe(queue_ms)
    if not met:
        runtime.metrics.deadline_misses.inc()
    runtime.planner.observe(job.plan, slack_ms)


def _exit_and_members(job: Job, record: EngineRecord) -> tuple[int, list[str]]:
    """The exit that answered (0: a combination of several models) and the models combined."""
    if job.plan.kind is PlanKind.MEMBERS:
        run = job.plan.members[: job.step]
        return (record.exit if isinstance(record, Rung) else 0) if len(run) == 1 else 0, run
    if isinstance(record, Ensemble):
        return 0, list(record.members)
    return (record.index if isinstance(record, Stage) else record.exit if isinstance(record, Rung) else 0), []


def _count(runtime: Runtime, options: ClassifyOptions | None, code: str) -> None:
    """Count a refused request. Its rung label is one of the ladder's names: a client's own string would make a new
    series on /metrics for every name sent."""
    if options is None:
        runtime.metrics.outcome("unknown", "", code).inc()
        return
    rung = options.rung or ""
    known = not rung or rung in runtime.planner.options
    runtime.metrics.outcome(options.policy, rung if known else "unknown", code).inc()


def _error(e: ApiError, clock: Clock, account: Callable[[], None] | None = None) -> Answer:
    headers = [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    return e.status, orjson.dumps(e.body()), [*headers, (b"server-timing", clock.server_timing())], account
