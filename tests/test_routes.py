"""The routes in process, through the ASGI interface, on the tiny ladder: every field of an answer against the
engine run by hand, every refusal's status, code and headers, bodies that stall or overflow, clients that
leave, a server that stops, health, the ladder and the OpenAPI document.

No server process: a request is one `app(scope, receive, send)` call, so a test decides what the client
sends and when (a body in pieces, a pause, a disconnect). What service/server.py adds in front (admission
in the HTTP parser, connection limits) is tested over sockets in tests/test_frontdoor.py; here a request
that the parser admitted is simulated by putting its `Admitted` in the scope.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from PIL import Image

from engines.base import entropy
from engines.ensemble import soft_vote
from engines.manifest import Ladder, Rung
from loadtest.http import server_timing
from service import admission
from service.app import create_app
from service.config import Settings
from service.errors import ApiError, QueueFull
from service.images import INLINE_MAX_PIXELS, TENSOR_DTYPES, Pending, open_item, parse_shape
from service.planner import OnInfeasible, Plan, Policy
from service.requests import INLINE_MAX_JSON
from service.routes import classify
from service.runtime import Runtime
from service.scheduler import Job
from service.schemas import ClassifyOptions
from service.server import LoopLag
from service.timing import PHASES, Clock, PathTime

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
EXIT1 = "exit1.fp32.onnxruntime"  # dominated: loaded on first use
EXIT3 = "exit3.fp32.onnxruntime"
STAGES = "cascade.fp32.onnxruntime"
ENSEMBLE = "ensemble.exit3+vgg_tiny.int8.onnxruntime"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def _scope(app: FastAPI, path: str, media: str | None, query: str, headers: dict[str, str]) -> dict[str, Any]:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if media is not None:
        raw.append((b"content-type", media.encode()))
    return {
        "type": "http",
        "method": "POST" if path.startswith("/v1/classify") else "GET",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": raw,
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 1),
        "client": ("127.0.0.1", 2),
        "state": {},
        "asgi": {"version": "3.0"},
        "app": app,
    }


def _body(body: bytes, leave: asyncio.Event | None = None) -> Receive:
    """The client sends `body` in one piece, then waits for its answer: for good, or until `leave` is set."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if leave is None:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")
        await leave.wait()
        return {"type": "http.disconnect"}

    return receive


async def _request(
    app: FastAPI,
    path: str,
    receive: Receive,
    media: str | None = "application/json",
    query: str = "",
    state: dict[str, Any] | None = None,
    **headers: str,
) -> Reply | None:
    """One request through the app; None when it sent nothing (the client left)."""
    scope = _scope(app, path, media, query, {k.replace("_", "-"): v for k, v in headers.items()})
    scope["state"].update(state or {})
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if not sent:
        return None
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    head = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    assert len(head) == len(sent[0]["headers"]), "a header sent twice"
    return Reply(sent[0]["status"], head, sent[1]["body"])


def call(app: FastAPI, path: str, body: bytes | Receive = b"", **kwargs: Any) -> Reply:
    reply = asyncio.run(_request(app, path, _body(body) if isinstance(body, bytes) else body, **kwargs))
    assert reply is not None, "no answer"
    return reply


def _json(**fields: Any) -> bytes:
    return orjson.dumps(fields)


def _image(seed: int, size: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    return buf.getvalue()


def _probs(logits: np.ndarray) -> np.ndarray:
    z = logits[0].astype(np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def _by_hand(runtime: Runtime, engine: str, image: np.ndarray) -> np.ndarray:
    """The engine's logits for the image, run directly (the input decoded as the service decodes it)."""
    x, _ = open_item(image.tolist(), runtime.spec).decode()
    return runtime.engines[engine].run(x)[-1]


def _metric(runtime: Runtime, name: str, **labels: str) -> float:
    return runtime.metrics.registry.get_sample_value(name, labels) or 0.0


def _timing(reply: Reply) -> dict[str, float]:
    return server_timing(reply.headers["server-timing"])


def _served(ladder_dir: Path, **settings: Any) -> FastAPI:
    """An app whose engines are loaded and whose worker runs (what the lifespan does)."""
    app = create_app(Settings(ladder=ladder_dir, **settings), load_in_background=False)
    app.state.runtime.load()
    assert app.state.runtime.ready.is_set(), app.state.runtime.failed
    return app


@pytest.fixture(scope="module")
def app(ladder_dir: Path) -> Iterator[FastAPI]:
    """Every tiny engine is quick enough to run inline (a lone image runs on the event loop)."""
    served = _served(ladder_dir, inline_max_ms=1.0)
    yield served
    served.state.runtime.close()


@pytest.fixture
def queued_app(ladder_dir: Path) -> Iterator[FastAPI]:
    """An app that runs nothing inline: every job goes through the queue to the worker."""
    served = _served(ladder_dir, inline_max_ms=0.0)
    yield served
    served.state.runtime.close()


class Held:
    """An engine that runs only once `gate` is set, and records which thread ran it."""

    def __init__(self, engine: Any, delay_s: float = 0.0) -> None:
        self.engine, self.delay_s = engine, delay_s
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(10)
        time.sleep(self.delay_s)
        return self.engine.run(x)  # type: ignore[no-any-return]


def _hold(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, engine: str, delay_s: float = 0.0) -> Held:
    held = Held(runtime.engines[engine], delay_s)
    monkeypatch.setitem(runtime.engines, engine, held)
    return held


# -- answers ---------------------------------------------------------------------------------------------------


def test_an_answer_is_the_rungs_own_output_with_every_field(app: FastAPI) -> None:
    runtime: Runtime = app.state.runtime
    image = _image(1)
    before = {
        "ok": _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT1, outcome="ok"),
        "exit": _metric(runtime, "anytime_exit_total", exit="1"),
        "latency": _metric(runtime, "anytime_latency_ms_count"),
        "queue": _metric(runtime, "anytime_queue_ms_count"),
        "encode": _metric(runtime, "anytime_phase_ms_count", phase="encode"),
    }
    body = _json(image=image.tolist(), deadline_ms=5000, policy="fixed", rung=EXIT1, top_k=3)
    reply = call(app, "/v1/classify", body, x_request_id="req-1")
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["content-length"] == str(len(reply.body))
    assert reply.headers["x-request-id"] == "req-1"
    answer = reply.json()
    probs = _probs(_by_hand(runtime, EXIT1, image))
    order = [int(i) for i in np.argsort(-probs)[:3]]
    names = runtime.ladder.class_names
    assert answer["request_id"] == "req-1"
    assert answer["label"] == order[0] and answer["class_name"] == names[order[0]]
    assert [t["label"] for t in answer["top_k"]] == order
    assert [t["class_name"] for t in answer["top_k"]] == [names[i] for i in order]
    assert [t["probability"] for t in answer["top_k"]] == pytest.approx([probs[i] for i in order], abs=1e-5)
    assert answer["entropy"] == pytest.approx(float(entropy(np.log(probs)[None])[0]), abs=1e-5)
    assert (answer["rung"], answer["policy"], answer["exit"], answer["members"]) == (EXIT1, "fixed", 1, [])
    assert (answer["precision"], answer["backend"]) == ("fp32", "onnxruntime")
    assert (answer["stages_run"], answer["batch_sizes"]) == (1, [1])
    assert answer["deadline_ms"] == 5000 and answer["deadline_met"] is True and answer["resized"] is False
    assert 0 <= answer["queue_ms"] <= answer["latency_ms"] < 5000
    assert answer["ladder_version"] == runtime.ladder_version and len(runtime.ladder_version) == 12
    assert _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT1, outcome="ok") == before["ok"] + 1
    assert _metric(runtime, "anytime_exit_total", exit="1") == before["exit"] + 1
    assert _metric(runtime, "anytime_latency_ms_count") == before["latency"] + 1
    assert _metric(runtime, "anytime_queue_ms_count") == before["queue"] + 1
    assert _metric(runtime, "anytime_phase_ms_count", phase="encode") == before["encode"] + 1
    assert runtime.in_flight == 0


def test_top_1_lists_the_label_alone_and_a_large_image_is_resized(app: FastAPI) -> None:
    runtime: Runtime = app.state.runtime
    image = _image(2, size=56)
    reply = call(app, "/v1/classify", _json(image=image.tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3))
    answer = reply.json()
    probs = _probs(_by_hand(runtime, EXIT3, image))
    assert reply.status == 200 and answer["resized"] is True and answer["exit"] == 3
    assert [t["label"] for t in answer["top_k"]] == [answer["label"]] == [int(probs.argmax())]
    assert answer["top_k"][0]["probability"] == pytest.approx(probs.max(), abs=1e-5)
    body = _json(image=image.tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3, top_k=2)
    assert [t["label"] for t in call(app, "/v1/classify", body).json()["top_k"]] == list(np.argsort(-probs)[:2])


def test_confident_logits_give_finite_probabilities_and_figures_are_rounded(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = app.state.runtime
    engine = runtime.engines[EXIT3]

    class Sure:  # logits in the thousands: exp() of them overflows unless shifted by the largest
        concurrent = True

        def run(self, x: np.ndarray) -> list[np.ndarray]:
            out = engine.run(x)
            return [*out[:-1], out[-1] * 1000.0]

    monkeypatch.setitem(runtime.engines, EXIT3, Sure())
    reply = call(app, "/v1/classify", _json(image=_image(15).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3))
    answer = reply.json()
    assert reply.status == 200 and answer["top_k"][0]["probability"] == pytest.approx(1.0)
    for name in ("latency_ms", "queue_ms"):
        assert round(answer[name], 3) == answer[name]


def test_server_timing_phases_add_up_to_the_time_in_the_app(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phases are laps of one clock (service/timing.py): in order, each once, and they sum to `app`. Here the
    hand-over to the scheduler, the run and the hand-back each take 20 ms or more, so each shows."""
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3, delay_s=0.05)
    check_room, job_done = runtime.scheduler.check_room, classify._Waiter.job_done

    def slow_check_room(n: int = 1) -> None:  # inside submit(), before it stamps the job submitted
        time.sleep(0.02)
        check_room(n)

    def slow_job_done(self: Any, job: Any) -> None:  # on the worker, after the job is stamped finished
        time.sleep(0.02)
        job_done(self, job)

    monkeypatch.setattr(runtime.scheduler, "check_room", slow_check_room)
    monkeypatch.setattr(classify._Waiter, "job_done", slow_job_done)
    monkeypatch.setitem(runtime.paths, "route", PathTime(min_samples=1))  # this one request's path counts
    body = _json(image=_image(3).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3)
    reply = call(queued_app, "/v1/classify", body)
    assert reply.status == 200 and held.threads == ["anytime-worker"]
    timing = _timing(reply)
    assert list(timing) == [*PHASES, "app"]
    assert all(ms >= 0 for ms in timing.values())
    assert timing["enqueue"] >= 20 and timing["run"] >= 50 and timing["handback"] >= 20
    assert timing["queue"] < timing["run"]  # the run is not counted as queueing too
    # Each phase ends where the next begins: together they are the time up to `encode`'s end, which `app` (taken
    # after it) can only exceed; by well under 10 ms unless this process was descheduled right there.
    phases = sum(ms for name, ms in timing.items() if name != "app")
    assert timing["app"] - 10.0 <= phases <= timing["app"] + 0.01
    answer = reply.json()
    assert timing["enqueue"] <= answer["queue_ms"] <= answer["latency_ms"] <= timing["app"] + 0.01
    # What plans allow for after this one: its time after planning outside the engine (hand-over, hand-back).
    path = runtime.paths["route"].ms
    assert timing["enqueue"] + timing["handback"] <= path < answer["latency_ms"] - timing["run"]


def test_a_batch_s_phases_are_those_of_its_image_answered_last(
    ladder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One image a run, 50 ms each: the second waits for the first, and the hand-back starts when it is done."""
    app = _served(ladder_dir, inline_max_ms=0.0, max_batch=1)
    try:
        _hold(app.state.runtime, monkeypatch, EXIT3, delay_s=0.05)
        body = _json(images=[_image(40).tolist()] * 2, deadline_ms=5000, policy="fixed", rung=EXIT3)
        reply = call(app, "/v1/classify/batch", body)
        assert reply.status == 200 and [r["batch_sizes"] for r in reply.json()["results"]] == [[1], [1]]
        timing = _timing(reply)
        assert timing["queue"] >= 40 and timing["run"] >= 50 and timing["handback"] < 40, timing
        phases = sum(ms for name, ms in timing.items() if name != "app")
        assert timing["app"] - 10.0 <= phases <= timing["app"] + 0.01
    finally:
        app.state.runtime.close()


def test_a_request_admitted_by_the_parser_is_planned_there_and_not_admitted_again(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = app.state.runtime
    scope = _scope(app, "/v1/classify", "image/png", f"deadline_ms=5000&policy=fixed&rung={EXIT3}", {})
    admitted = admission.admit(runtime, scope, False, time.monotonic())
    assert admitted.plan is not None and admitted.plan.name == EXIT3

    def again(*args: Any) -> None:
        raise AssertionError("admitted twice")

    monkeypatch.setattr("service.routes.classify.admit", again)
    parser, route = runtime.paths["parser"]._count, runtime.paths["route"]._count
    reply = call(app, "/v1/classify", _png(_image(4)), media="image/png", state={"admitted": admitted})
    assert reply.status == 200 and reply.json()["rung"] == EXIT3
    assert (runtime.paths["parser"]._count, runtime.paths["route"]._count) == (parser + 1, route)
    monkeypatch.undo()
    reply = call(app, "/v1/classify", _json(image=_image(4).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3))
    assert reply.status == 200 and (runtime.paths["parser"]._count, runtime.paths["route"]._count) == (
        parser + 1,
        route + 1,
    )


def test_each_admitted_request_tells_the_loop_lag_its_deadline(app: FastAPI) -> None:
    """service/server.py's LoopLag lets the loop fall further behind while every recent deadline is loose; the
    route tells it each deadline, whether the options came in the JSON body or the query string."""
    runtime: Runtime = app.state.runtime
    lag = LoopLag(budget_ms=2.0, window=2)
    state = {"loop_lag": lag, "metrics": runtime.metrics}
    reply = call(app, "/v1/classify", _json(image=_image(4).tolist(), deadline_ms=80), state=dict(state))
    assert reply.status == 200 and lag.allowed_ms() == pytest.approx(0.4 * 80)
    reply = call(app, "/v1/classify", _png(_image(4)), media="image/png", query="deadline_ms=60", state=dict(state))
    assert reply.status == 200 and lag.allowed_ms() == pytest.approx(0.4 * 60)


def test_every_kind_of_plan_names_its_exit_and_members(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime: Runtime = app.state.runtime
    image = _image(5)

    def classify(rung: str) -> dict[str, Any]:
        reply = call(app, "/v1/classify", _json(image=image.tolist(), deadline_ms=5000, policy="fixed", rung=rung))
        assert reply.status == 200, reply.body
        return reply.json()  # type: ignore[no-any-return]

    ensemble = runtime.records[ENSEMBLE]
    answer = classify(ENSEMBLE)
    assert (answer["exit"], answer["members"], answer["stages_run"]) == (0, ensemble.members, 1)  # type: ignore[union-attr]
    members = runtime.ladder.member_cascades[0]  # which the tiny build keeps follows its val accuracies
    monkeypatch.setattr(runtime.planner, "continue_cascade", lambda *args: False)
    answer = classify(members.name)  # the first member alone: its exit (which one the tiny build puts first varies)
    first = runtime.records[members.members[0]]
    assert isinstance(first, Rung) and first.exit >= 1
    assert (answer["exit"], answer["members"], answer["stages_run"]) == (first.exit, members.members[:1], 1)
    answer = classify(STAGES)  # the first stage alone: exit 1
    assert (answer["exit"], answer["members"], answer["stages_run"]) == (1, [], 1)
    monkeypatch.setattr(runtime.planner, "continue_cascade", lambda plan, step, *args: step < len(plan.engines))
    answer = classify(STAGES)  # every stage: the last one's index
    assert (answer["exit"], answer["members"], answer["stages_run"], answer["batch_sizes"]) == (3, [], 3, [1, 1, 1])
    answer = classify(members.name)  # every member: a combination, exit 0, and its probabilities are the soft vote
    assert (answer["exit"], answer["members"], answer["stages_run"]) == (0, members.members, len(members.members))
    vote = soft_vote([_by_hand(runtime, m, image) for m in members.members])[0]
    assert answer["label"] == int(vote.argmax()) and answer["top_k"][0]["probability"] == pytest.approx(
        vote.max(), abs=1e-5
    )


def test_a_batch_answers_each_image_under_its_own_id_on_the_worker(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    images = [_image(10 + i) for i in range(3)]
    body = _json(images=[i.tolist() for i in images], deadline_ms=5000, policy="fixed", rung=EXIT3)
    reply = call(app, "/v1/classify/batch", body, x_request_id="b")
    assert reply.status == 200 and reply.headers["x-request-id"] == "b"
    results = reply.json()["results"]
    assert [r["request_id"] for r in results] == ["b.0", "b.1", "b.2"]
    assert set(held.threads) == {"anytime-worker"}  # a batch's images go through the queue
    assert [r["label"] for r in results] == [int(_probs(_by_hand(runtime, EXIT3, i)).argmax()) for i in images]
    held.threads.clear()
    single = call(app, "/v1/classify", _json(image=images[0].tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3))
    assert single.status == 200 and single.json()["label"] == results[0]["label"]
    assert held.threads == [threading.current_thread().name]  # a lone quick image runs at once, on the loop
    assert runtime.in_flight == 0 and runtime.scheduler.depth() == 0


def test_a_loose_deadline_runs_inline_only_for_the_one_request_in_the_app(
    ladder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone image with a deadline tighter than ANYTIME_INLINE_MAX_DEADLINE_MS (inclusive) runs on the event loop
    whatever else is in the app; a looser one does only while it is the one request in the app, and else goes to
    the worker, where it can be batched."""
    app = _served(ladder_dir, inline_max_ms=1.0, inline_max_deadline_ms=1000.0)
    runtime: Runtime = app.state.runtime
    here = threading.current_thread().name

    def single(deadline_ms: float) -> bytes:
        return _json(image=_image(5).tolist(), deadline_ms=deadline_ms, policy="fixed", rung=EXIT1)

    assert call(app, "/v1/classify", single(5000)).status == 200  # loads the dominated rung
    quick, busy = _hold(runtime, monkeypatch, EXIT1), _hold(runtime, monkeypatch, EXIT3)
    try:  # `finally` below needs `busy`: a failure before it leaves nothing held
        assert call(app, "/v1/classify", single(5000)).status == 200
        assert quick.threads == [here]  # alone in the app: at once, on the loop
        quick.threads.clear()
        busy.gate.clear()

        async def scenario() -> list[Reply | None]:
            images = _json(images=[_image(6).tolist()] * 2, deadline_ms=5000, policy="fixed", rung=EXIT3)
            batch = asyncio.create_task(_request(app, "/v1/classify/batch", _body(images)))
            await asyncio.to_thread(busy.entered.wait, 5)  # the worker is held inside EXIT3
            tight = await _request(app, "/v1/classify", _body(single(1000)))
            assert quick.threads == [here]  # answered while the worker is held: it ran on the loop
            loose = asyncio.create_task(_request(app, "/v1/classify", _body(single(1001))))
            await asyncio.sleep(0.1)
            assert not loose.done() and quick.threads == [here]  # queued behind the batch
            busy.gate.set()
            return [tight, await batch, await loose]

        replies = asyncio.run(scenario())
        assert [r.status for r in replies if r is not None] == [200, 200, 200]
        assert quick.threads == [here, "anytime-worker"]
    finally:
        busy.gate.set()
        runtime.close()


def test_each_image_of_a_batch_is_planned_behind_the_ones_before_it(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    held.gate.clear()  # nothing finishes while the batch is planned
    plan_for, queued = classify.plan_for, []

    def spy(*args: Any) -> Any:
        queued.append(runtime.scheduler.depth())
        return plan_for(*args)

    monkeypatch.setattr(classify, "plan_for", spy)

    async def scenario() -> Reply | None:
        body = _json(images=[_image(30).tolist()] * 3, deadline_ms=5000, policy="fixed", rung=EXIT3)
        request = asyncio.create_task(_request(queued_app, "/v1/classify/batch", _body(body)))
        await asyncio.to_thread(held.entered.wait, 5)
        held.gate.set()
        return await request

    reply = asyncio.run(scenario())
    assert reply is not None and reply.status == 200
    assert queued == [0, 1, 2]  # once after parsing, then once per further image, with the earlier ones queued


class _Where:
    """Records the thread that parses a JSON body, opens its images and decodes them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: dict[str, str] = {}
        parse_json, open_all = classify.parse_json, classify.open_all

        def parse(*args: Any) -> Any:
            self.threads["parse"] = threading.current_thread().name
            return parse_json(*args)

        def opened(*args: Any) -> list[Pending]:
            self.threads["open"] = threading.current_thread().name
            return [Pending(p.pixels, self._decoding(p)) for p in open_all(*args)]

        monkeypatch.setattr(classify, "parse_json", parse)
        monkeypatch.setattr(classify, "open_all", opened)

    def _decoding(self, pending: Pending) -> Callable[[], Any]:
        def decode() -> Any:
            self.threads["decode"] = threading.current_thread().name
            return pending.decode()

        return decode

    def off_loop(self) -> set[str]:
        here = threading.current_thread().name
        return {step for step, thread in self.threads.items() if thread != here}


def _padded(body: bytes, size: int) -> bytes:
    """The JSON body made `size` bytes long (JSON allows trailing white space)."""
    assert len(body) <= size
    return body + b" " * (size - len(body))


def test_large_bodies_and_images_are_parsed_and_decoded_off_the_event_loop(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 64 KiB of body and 128 x 128 pixels on the event loop (quicker than a hand-off), more in the decode
    thread; each limit is inclusive."""
    assert (INLINE_MAX_JSON, INLINE_MAX_PIXELS) == (64 * 1024, 128 * 128)
    where = _Where(monkeypatch)
    pixels = _json(image=_image(31).tolist(), deadline_ms=5000)

    def png(size: int) -> bytes:
        return _json(image=base64.b64encode(_png(_image(31, size=size))).decode(), deadline_ms=5000)

    for body, off in (
        (_padded(pixels, INLINE_MAX_JSON), set()),
        (_padded(pixels, INLINE_MAX_JSON + 1), {"parse", "open"}),  # 28 x 28 pixels: decoded on the loop
        (png(128), set()),
        (png(129), {"decode"}),
    ):
        where.threads.clear()
        reply = call(app, "/v1/classify", body)
        assert reply.status == 200, reply.body
        assert where.off_loop() == off and set(where.threads) == {"parse", "open", "decode"}


def test_every_body_form_reaches_the_same_answer(app: FastAPI) -> None:
    """JSON pixels, base64 PNG in JSON, a raw PNG, a uint8 tensor, a multipart file; and a JSON batch too large
    to parse on the event loop (> 64 KiB: parsed and decoded in the decode thread)."""
    image = _image(6)
    png = _png(image)
    rung = f"policy=fixed&rung={EXIT3}"
    options = {"deadline_ms": 5000, "policy": "fixed", "rung": EXIT3}
    replies = [
        call(app, "/v1/classify", _json(image=image.tolist(), **options)),
        call(app, "/v1/classify", _json(image=base64.b64encode(png).decode(), **options)),
        call(app, "/v1/classify", png, media="image/png", query=f"deadline_ms=5000&{rung}"),
        call(
            app,
            "/v1/classify",
            image.tobytes(),
            media="application/x-tensor",
            query=f"{rung}&dtype=uint8&shape=28,28",
            x_deadline_ms="5000",
        ),
    ]
    boundary = "b0undary"
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="deadline_ms"\r\n\r\n5000\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + png
        + f"\r\n--{boundary}--\r\n".encode()
    )
    replies.append(call(app, "/v1/classify", form, media=f"multipart/form-data; boundary={boundary}", query=rung))
    assert [r.status for r in replies] == [200] * 5, [r.body for r in replies]
    assert len({r.json()["label"] for r in replies}) == 1
    assert len({round(r.json()["top_k"][0]["probability"], 5) for r in replies}) == 1
    many = [image.tolist()] * 40
    body = _json(images=many, **options)
    assert len(body) > 64 * 1024
    reply = call(app, "/v1/classify/batch", body)
    assert reply.status == 200 and {r["label"] for r in reply.json()["results"]} == {replies[0].json()["label"]}


# -- refusals --------------------------------------------------------------------------------------------------


def _error(reply: Reply, status: int, code: str, retry_after: str | None = None) -> dict[str, Any]:
    assert reply.status == status, reply.body
    body: dict[str, Any] = reply.json()
    assert body["code"] == code and body["message"], body
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["content-length"] == str(len(reply.body))
    assert reply.headers["x-request-id"] and "app" in _timing(reply)
    assert reply.headers.get("retry-after") == retry_after
    return body


def _no_body() -> Receive:
    async def receive() -> Message:
        raise AssertionError("the body was read")

    return receive


def test_refusals_before_the_body_are_counted_without_options(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime: Runtime = app.state.runtime
    media = _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="unsupported_media_type")
    reply = call(app, "/v1/classify", _no_body(), media="text/plain")
    assert "text/plain" in _error(reply, 415, "unsupported_media_type")["message"]
    assert _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="unsupported_media_type") == (
        media + 1
    )
    # A binary body's options are all in the query: its plan is refused before the body is read, by admission,
    # which does not hand the options it read back to the count.
    unknown = _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="unknown_rung")
    reply = call(app, "/v1/classify", _no_body(), media="image/png", query="deadline_ms=50&policy=fixed&rung=nope")
    _error(reply, 404, "unknown_rung")
    assert _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="unknown_rung") == unknown + 1
    monkeypatch.setattr(runtime.ready, "is_set", lambda: False)
    _error(call(app, "/v1/classify", _no_body()), 503, "not_ready", retry_after="1")
    assert runtime.in_flight == 0


def test_a_deadline_is_a_finite_number_and_a_multipart_refusal_says_what_is_wrong(app: FastAPI) -> None:
    """NaN and infinity in the query or a header (text that pydantic's lax mode reads as a float) were refused as
    "less than or equal to 60000", and JSON true was taken as a 1 ms deadline; a multipart body without a boundary
    was refused naming only the exception's type."""
    png = _png(_image(7))
    for text in ("nan", "inf", "-inf", "1e400"):
        reply = call(app, "/v1/classify", _no_body(), media="image/png", query=f"deadline_ms={text}")
        assert "finite" in _error(reply, 422, "invalid_request")["message"], text
        reply = call(app, "/v1/classify", png, media="image/png", x_deadline_ms=text)
        assert "finite" in _error(reply, 422, "invalid_request")["message"], text
    for field, options in (("deadline_ms", {"deadline_ms": True}), ("top_k", {"deadline_ms": 50, "top_k": False})):
        reply = call(app, "/v1/classify", _json(image=_image(7).tolist(), **options))
        message = _error(reply, 422, "invalid_request")["message"]
        assert message == f"{field}: Input should be a number, not true or false"
    # Numbers as text stay accepted: query strings and headers are text.
    reply = call(app, "/v1/classify", png, media="image/png", query="deadline_ms=5000&top_k=3")
    assert reply.status == 200 and len(reply.json()["top_k"]) == 3
    reply = call(app, "/v1/classify", b"--x\r\n", media="multipart/form-data", query="deadline_ms=5000")
    assert "boundary" in _error(reply, 422, "invalid_request")["message"]


def test_a_classify_post_goes_straight_to_its_route_and_other_methods_through_the_router(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    routed: list[bool] = []  # Starlette's router marks the scopes it dispatches ("router")
    handle = classify._handle

    async def spy(scope: Any, receive: Receive, batch: bool) -> classify.Answer:
        routed.append("router" in scope)
        return await handle(scope, receive, batch)

    monkeypatch.setattr(classify, "_handle", spy)
    assert call(app, "/v1/classify", _json(image=_image(7).tolist(), deadline_ms=1000)).status == 200
    images = [_image(8).tolist()] * 2
    assert call(app, "/v1/classify/batch", _json(images=images, deadline_ms=1000)).status == 200
    assert routed == [False, False]
    scope = _scope(app, "/v1/classify", None, "", {})
    scope["method"] = "GET"
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, _body(b""), send))
    assert sent[0]["status"] == 405 and orjson.loads(sent[1]["body"])["code"] == "method_not_allowed"
    assert routed == [False, False]


def test_refusals_after_parsing_name_the_policy_and_rung(app: FastAPI, ladder_dir: Path) -> None:
    runtime: Runtime = app.state.runtime
    # A name the ladder lacks is counted as "unknown": each client string as a label would be a new series on /metrics.
    before = _metric(runtime, "anytime_requests_total", policy="fixed", rung="unknown", outcome="unknown_rung")
    for name in ("nope", "nope-2"):
        reply = call(app, "/v1/classify", _json(image=_image(7).tolist(), deadline_ms=50, policy="fixed", rung=name))
        _error(reply, 404, "unknown_rung")
    assert _metric(runtime, "anytime_requests_total", policy="fixed", rung="unknown", outcome="unknown_rung") == (
        before + 2
    )
    assert b'rung="nope' not in runtime.metrics.render()
    invalid = _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="invalid_request")
    _error(call(app, "/v1/classify", _json(image=_image(7).tolist())), 422, "invalid_request")  # no deadline
    assert _metric(runtime, "anytime_requests_total", policy="unknown", rung="", outcome="invalid_request") == (
        invalid + 1
    )
    # A safety margin over the shortest deadline (1 ms) makes it infeasible on any machine: on a fast one the
    # tiny ladder's quickest engine and the default margin fit within 1 ms.
    strict = _served(ladder_dir, safety_margin_ms=2.0)
    try:
        runtime = strict.state.runtime
        auto = _metric(runtime, "anytime_requests_total", policy="auto", rung="", outcome="deadline_infeasible")
        reply = call(strict, "/v1/classify", _json(image=_image(7).tolist(), deadline_ms=1))
        body = _error(reply, 503, "deadline_infeasible")
        assert body["fastest_ms"] > 0
        outcome = _metric(runtime, "anytime_requests_total", policy="auto", rung="", outcome="deadline_infeasible")
        assert outcome == auto + 1
    finally:
        strict.state.runtime.close()


def test_a_batch_needs_queue_room_for_every_image(ladder_dir: Path) -> None:
    app = _served(ladder_dir, max_queue=2)
    try:
        images = [_image(20).tolist()] * 3
        reply = call(app, "/v1/classify/batch", _json(images=images, deadline_ms=5000))
        _error(reply, 429, "queue_full", retry_after="1")
        reply = call(app, "/v1/classify/batch", _json(images=images[:2], deadline_ms=5000))
        assert reply.status == 200 and len(reply.json()["results"]) == 2
    finally:
        app.state.runtime.close()


def test_a_batch_is_queued_whole_or_not_at_all(queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime: Runtime = queued_app.state.runtime
    scheduler = runtime.scheduler
    real = scheduler.submit
    submitted: list[Any] = []

    def second_refused(job: Any, inline: bool = False) -> None:
        if submitted:
            raise QueueFull("full", headers={"Retry-After": "1"})
        submitted.append(job)
        real(job, inline)

    monkeypatch.setattr(scheduler, "submit", second_refused)
    body = _json(images=[_image(21).tolist()] * 3, deadline_ms=5000, policy="fixed", rung=EXIT3)
    _error(call(queued_app, "/v1/classify/batch", body), 429, "queue_full", retry_after="1")
    assert len(submitted) == 1 and submitted[0].cancelled  # the first is withdrawn (dropped after its run, if any)
    deadline = time.monotonic() + 5
    while scheduler.depth() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert scheduler.depth() == 0


# -- bodies that stall or overflow, clients that leave, a server that stops ------------------------------------


def _pieces(*pieces: bytes, pause_s: float = 0.0, then_leave: bool = False) -> Receive:
    """The body in pieces, a pause before the last one; or, with `then_leave`, the client leaves instead of it."""
    queue = list(pieces)

    async def receive() -> Message:
        if len(queue) == 1:
            await asyncio.sleep(pause_s)
            if then_leave:
                return {"type": "http.disconnect"}
        if not queue:
            await asyncio.Event().wait()
        piece = queue.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(queue)}

    return receive


def test_a_body_arriving_in_pieces_is_held_to_the_size_limit(ladder_dir: Path) -> None:
    app = _served(ladder_dir, max_body_bytes=1024)
    try:
        reply = call(app, "/v1/classify", _pieces(b" " * 1000, b" " * 100), query="deadline_ms=5000")
        _error(reply, 413, "payload_too_large")
        reply = call(app, "/v1/classify", b" " * 1025, media="image/png", query="deadline_ms=5000")
        _error(reply, 413, "payload_too_large")
    finally:
        app.state.runtime.close()


def test_a_stalled_body_gets_408_at_the_body_timeout_or_504_at_a_nearer_deadline(ladder_dir: Path) -> None:
    app = _served(ladder_dir, body_timeout_s=0.5)
    png = _png(_image(8))
    try:
        start = time.monotonic()
        reply = call(
            app, "/v1/classify", _pieces(png[:10], png[10:], pause_s=5), media="image/png", query="deadline_ms=60"
        )
        message = _error(reply, 504, "deadline_expired")["message"]
        assert message == "the deadline passed while the body was still arriving"
        assert 0.05 <= time.monotonic() - start < 0.45  # at the deadline, before the body timeout
        # A deadline as far off as the body timeout: the body timeout answers (the deadline is not nearer).
        reply = call(
            app, "/v1/classify", _pieces(png[:10], png[10:], pause_s=5), media="image/png", query="deadline_ms=500"
        )
        assert _error(reply, 408, "body_timeout")["message"] == "the body did not arrive within 0.5 s"
        # A JSON body's deadline is known only once it is read: the body timeout applies.
        reply = call(app, "/v1/classify", _pieces(b'{"deadline_ms": 50, ', b"}", pause_s=5))
        _error(reply, 408, "body_timeout")
        reply = call(
            app, "/v1/classify", _pieces(png[:10], png[10:], pause_s=0.01), media="image/png", query="deadline_ms=5000"
        )
        assert reply.status == 200  # pieces that keep coming in time make a body
    finally:
        app.state.runtime.close()


def test_a_client_that_leaves_mid_body_gets_nothing_and_is_counted(app: FastAPI) -> None:
    runtime: Runtime = app.state.runtime
    before = _metric(runtime, "anytime_disconnects_total", where="receive")
    receive = _pieces(b'{"deadline_ms": 5000, ', b"}", then_leave=True)
    assert asyncio.run(_request(app, "/v1/classify", receive)) is None
    assert _metric(runtime, "anytime_disconnects_total", where="receive") == before + 1
    assert runtime.in_flight == 0


def test_clients_that_leave_while_queued_or_running_free_their_slots(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    held.gate.clear()
    body = _json(image=_image(9).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3)

    async def scenario() -> tuple[Reply | None, Reply | None]:
        leave = [asyncio.Event(), asyncio.Event()]
        running = asyncio.create_task(_request(queued_app, "/v1/classify", _body(body, leave[0])))
        await asyncio.to_thread(held.entered.wait, 5)  # the first is in the engine
        queued = asyncio.create_task(_request(queued_app, "/v1/classify", _body(body, leave[1])))
        while runtime.scheduler.depth() < 2:
            await asyncio.sleep(0.001)
        leave[1].set()  # the queued one leaves: its slot frees at once
        while runtime.scheduler.depth() > 1:
            await asyncio.sleep(0.001)
        leave[0].set()  # the running one leaves; its engine call finishes, then it is dropped
        await asyncio.sleep(0.01)
        held.gate.set()
        replies = await running, await queued
        deadline = time.monotonic() + 5
        while runtime.scheduler.depth() and time.monotonic() < deadline:  # the engine call ends, then the job goes
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # its completion reaches this loop before it closes
        return replies

    metrics = {w: _metric(runtime, "anytime_disconnects_total", where=w) for w in ("queued", "running")}
    assert asyncio.run(scenario()) == (None, None)
    assert _metric(runtime, "anytime_disconnects_total", where="queued") == metrics["queued"] + 1
    assert _metric(runtime, "anytime_disconnects_total", where="running") == metrics["running"] + 1
    assert held.threads == ["anytime-worker"]  # the queued one never ran
    assert runtime.scheduler.depth() == 0 and runtime.in_flight == 0


def test_a_server_that_stops_answers_waiting_requests_503(queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled when the drain time is over, a waiting request still answers, and its queued job goes."""
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    held.gate.clear()
    body = _json(image=_image(11).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3)
    sent: list[Message] = []

    async def scenario() -> None:
        async def send(message: Message) -> None:
            sent.append(message)

        first = asyncio.create_task(
            queued_app(_scope(queued_app, "/v1/classify", "application/json", "", {}), _body(body), send)
        )
        await asyncio.to_thread(held.entered.wait, 5)
        second = asyncio.create_task(
            queued_app(_scope(queued_app, "/v1/classify", "application/json", "", {}), _body(body), send)
        )
        while runtime.scheduler.depth() < 2:
            await asyncio.sleep(0.001)
        second.cancel()  # what uvicorn does to a request still running when the drain time is over
        await second

        held.gate.set()
        await first

    asyncio.run(scenario())
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [503, 200]
    assert dict(sent[0]["headers"])[b"retry-after"] == b"1"
    assert orjson.loads(sent[1]["body"]) == {"code": "shutting_down", "message": "the server is shutting down"}
    assert runtime.scheduler.depth() == 0 and runtime.in_flight == 0


def test_a_job_the_stopping_scheduler_answers_is_refused_503_and_counted(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    held.gate.clear()
    body = _json(image=_image(12).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3)
    before = _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="shutting_down")

    async def scenario() -> list[Reply | None]:
        first = asyncio.create_task(_request(queued_app, "/v1/classify", _body(body)))
        await asyncio.to_thread(held.entered.wait, 5)
        second = asyncio.create_task(_request(queued_app, "/v1/classify", _body(body)))
        while runtime.scheduler.depth() < 2:
            await asyncio.sleep(0.001)
        stopper = threading.Thread(target=runtime.scheduler.stop)
        stopper.start()  # answers the queued job at once, then waits for the running one
        reply = await second
        held.gate.set()
        await asyncio.to_thread(stopper.join, 5)
        return [await first, reply]

    first, second = asyncio.run(scenario())
    assert first is not None and first.status == 200
    assert second is not None
    _error(second, 503, "shutting_down", retry_after="1")
    assert _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="shutting_down") == (
        before + 1
    )


def test_a_late_answer_is_504_unless_the_client_takes_best_effort(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine takes 60 ms where its profile says well under 1: planned in time, answered late."""
    runtime: Runtime = queued_app.state.runtime
    _hold(runtime, monkeypatch, EXIT3, delay_s=0.06)
    options = {"image": _image(13).tolist(), "deadline_ms": 30, "policy": "fixed", "rung": EXIT3}
    late = _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="deadline_expired")
    misses = _metric(runtime, "anytime_deadline_misses_total")
    digits = set()
    for _ in range(3):
        body = _error(call(queued_app, "/v1/classify", _json(**options)), 504, "deadline_expired")
        assert 20 <= body["late_ms"] < 1000
        assert body["message"] == f"the answer was ready {body['late_ms']} ms after the deadline"
        digits.add(len(f"{body['late_ms']:.6f}".rstrip("0").split(".")[1]))
    assert max(digits) <= 3  # rounded to the microsecond
    assert _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="deadline_expired") == (
        late + 3
    )
    assert _metric(runtime, "anytime_deadline_misses_total") == misses + 3
    accepted = _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="late")
    reply = call(queued_app, "/v1/classify", _json(**options, on_infeasible="best_effort"))
    assert reply.status == 200 and reply.json()["deadline_met"] is False and reply.json()["latency_ms"] > 30
    assert _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="late") == accepted + 1
    assert _metric(runtime, "anytime_deadline_misses_total") == misses + 4


def test_a_job_is_due_its_deadline_after_the_request_s_arrival(app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime: Runtime = app.state.runtime
    jobs: list[Any] = []
    submit = runtime.scheduler.submit

    def recording(job: Any, **kwargs: Any) -> None:
        jobs.append(job)
        submit(job, **kwargs)

    monkeypatch.setattr(runtime.scheduler, "submit", recording)
    reply = call(app, "/v1/classify", _json(image=_image(14).tolist(), deadline_ms=45000, policy="fixed", rung=EXIT3))
    assert reply.status == 200 and len(jobs) == 1
    assert jobs[0].deadline - jobs[0].arrival == pytest.approx(45.0, abs=1e-6)


def test_a_body_may_take_until_the_deadline_when_it_is_nearer_than_the_body_timeout() -> None:
    runtime: Any = SimpleNamespace(settings=SimpleNamespace(body_timeout_s=100.0))
    arrival = time.monotonic() - 1.0
    before = time.monotonic()
    left, error = classify._body_limit(runtime, ClassifyOptions(deadline_ms=60000), SimpleNamespace(arrival=arrival))
    after = time.monotonic()
    assert arrival + 60.0 - after <= left <= arrival + 60.0 - before  # 59 s: the deadline, not the 100 s timeout
    assert error.code == "deadline_expired"
    past = SimpleNamespace(arrival=time.monotonic() - 61.0)
    assert classify._body_limit(runtime, ClassifyOptions(deadline_ms=60000), past)[0] == 0.0


def test_latency_and_queue_time_are_reported_in_ms_from_arrival(app: FastAPI) -> None:
    """Times far enough apart that a wrong unit or scale shows: arrival 100 s ago, started 50 s after it."""
    runtime: Runtime = app.state.runtime
    arrival = time.monotonic() - 100.0
    plan = Plan(Policy.FIXED, EXIT3, [EXIT3])
    job = Job("far", arrival, arrival + 200.0, np.zeros((1, 1, 28, 28), np.float32), plan, lambda _: None)
    job.logits, job.started, job.step = np.zeros((1, len(runtime.ladder.class_names)), np.float32), arrival + 50.0, 1
    options = ClassifyOptions(deadline_ms=60000, policy=Policy.FIXED, rung=EXIT3)
    before = time.monotonic()
    answer = classify._answer(runtime, job, options, resized=False)
    after = time.monotonic()
    assert (before - arrival) * 1e3 - 5e-4 <= answer["latency_ms"] <= (after - arrival) * 1e3 + 5e-4
    assert answer["queue_ms"] == pytest.approx(50000.0, abs=1e-3)
    assert answer["deadline_met"] is True
    job.deadline = arrival + 50.0  # passed 50 s ago
    before = time.monotonic()
    with pytest.raises(ApiError) as late:
        classify._answer(runtime, job, options, resized=False)
    after = time.monotonic()
    assert late.value.code == "deadline_expired"
    assert (before - job.deadline) * 1e3 - 5e-4 <= late.value.extra["late_ms"] <= (after - job.deadline) * 1e3 + 5e-4


def test_an_answer_is_counted_once_written_and_a_failed_batch_counts_the_images_answered_before(app: FastAPI) -> None:
    """`_encode` leaves an answer's bookkeeping to the function it returns (run once the response is written): until
    it runs nothing is counted; a batch whose second image failed answers that error and still counts its first."""
    runtime: Runtime = app.state.runtime
    arrival = time.monotonic()
    plan = Plan(Policy.FIXED, EXIT3, [EXIT3])
    options = ClassifyOptions(deadline_ms=60000, policy=Policy.FIXED, rung=EXIT3)
    x = np.zeros((1, 1, 28, 28), np.float32)

    def answered(name: str) -> Job:
        job = Job(name, arrival, arrival + 60.0, x, plan, lambda _: None)
        job.logits, job.started, job.step = np.zeros((1, len(runtime.ladder.class_names)), np.float32), arrival, 1
        return job

    def counts() -> tuple[float, ...]:
        return (
            _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="ok"),
            _metric(runtime, "anytime_requests_total", policy="fixed", rung=EXIT3, outcome="queue_full"),
            _metric(runtime, "anytime_latency_ms_count"),
            _metric(runtime, "anytime_phase_ms_count", phase="encode"),
        )

    ok, full, latency, encode = counts()
    reply = classify._encode(runtime, [answered("one")], [False], options, Clock(arrival), batch=False)
    assert reply is not None and reply[0] == 200 and reply[3] is not None
    assert counts() == (ok, full, latency, encode)  # nothing yet: the client does not wait for it
    reply[3]()
    assert counts() == (ok + 1, full, latency + 1, encode + 1)

    failed = answered("two")
    failed.error = QueueFull("full")
    reply = classify._encode(runtime, [answered("one"), failed], [False, False], options, Clock(arrival), batch=True)
    assert reply is not None and reply[0] == 429 and reply[3] is not None
    assert counts() == (ok + 1, full + 1, latency + 1, encode + 1)  # the error is counted at once
    reply[3]()
    assert counts() == (ok + 2, full + 1, latency + 2, encode + 1)  # the image answered before it; no phases


# -- health, the ladder, the OpenAPI document ------------------------------------------------------------------


def _get(app: FastAPI, path: str) -> Reply:
    return call(app, path, b"", media=None)


def test_health_says_alive_ready_or_why_not(ladder_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(Settings(ladder=ladder_dir), load_in_background=False)  # nothing loaded yet
    runtime: Runtime = app.state.runtime
    reply = _get(app, "/healthz")
    assert (reply.status, reply.json()) == (200, {"status": "ok"})
    reply = _get(app, "/readyz")
    assert reply.status == 503 and reply.headers["retry-after"] == "1"
    assert reply.json() == {"code": "not_ready", "message": f"loading: 0 of {len(runtime.served)} engines warmed"}
    runtime.failed = "OSError: /secret/path"
    reply = _get(app, "/readyz")
    assert reply.status == 503 and "retry-after" not in reply.headers
    assert reply.json() == {"code": "load_failed", "message": "the ladder could not be loaded"}
    runtime.failed = None
    runtime.load()
    try:
        reply = _get(app, "/readyz")
        assert reply.status == 200 and reply.headers["content-type"] == "application/json"
        assert reply.json() == {
            "status": "ready",
            "engines": len(runtime.served),
            "ladder_version": runtime.ladder_version,
        }
        assert (_get(app, "/healthz").status, runtime.scheduler.alive) == (200, True)
        monkeypatch.setattr(runtime.scheduler, "crashed", True)
        reply = _get(app, "/healthz")
        assert reply.status == 503 and reply.json() == {
            "code": "worker_dead",
            "message": "the scheduler's worker stopped",
        }
    finally:
        runtime.close()


def test_metrics_show_the_queue_depth_at_the_time_of_the_scrape(
    queued_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: Runtime = queued_app.state.runtime
    held = _hold(runtime, monkeypatch, EXIT3)
    held.gate.clear()
    body = _json(image=_image(14).tolist(), deadline_ms=5000, policy="fixed", rung=EXIT3)

    async def scenario() -> tuple[Reply, Reply | None]:
        waiting = asyncio.create_task(_request(queued_app, "/v1/classify", _body(body)))
        await asyncio.to_thread(held.entered.wait, 5)
        scrape = await _request(queued_app, "/metrics", _body(b""), media=None)
        held.gate.set()
        return scrape, await waiting  # type: ignore[return-value]

    scrape, answer = asyncio.run(scenario())
    assert answer is not None and answer.status == 200
    assert scrape.status == 200 and scrape.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "\nanytime_queue_depth 1.0\n" in scrape.body.decode()
    assert "\nanytime_queue_depth 0.0\n" in _get(queued_app, "/metrics").body.decode()


def test_the_ladder_route_serves_the_manifest_with_its_version(app: FastAPI, ladder: Ladder) -> None:
    runtime: Runtime = app.state.runtime
    reply = _get(app, "/v1/ladder")
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    assert reply.headers["x-ladder-version"] == runtime.ladder_version
    assert reply.body == runtime.ladder_json
    assert [r.name for r in Ladder.model_validate_json(reply.body).rungs] == [r.name for r in ladder.rungs]
    # The per-image val records (the planner's, kilobytes each) stay out of the reply; ladder.json has them.
    assert ladder.rungs[0].val_right_by_depth and b"val_right_by_depth" not in reply.body


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _errors_by_status() -> dict[int, list[str]]:
    """Every error code the service answers with, by status (service/errors.py; worker_dead and load_failed come
    from the health routes)."""
    by_status: dict[int, list[str]] = {503: ["worker_dead", "load_failed"]}
    stack = list(ApiError.__subclasses__())
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        by_status.setdefault(cls.status, []).append(cls.code)
    return by_status


def test_openapi_states_each_option_s_default_as_the_schema_has_it(app: FastAPI) -> None:
    """The options' parameters whole (the words are the API's documentation); the defaults they state are the
    request schema's (one said `cascade` after `auto` became the default)."""
    fields = ClassifyOptions.model_fields
    assert fields["policy"].default == Policy.AUTO  # the words below follow the schema, whatever it says
    deadline = {"type": "number", "minimum": 1, "maximum": 60000}
    expected = {
        "deadline_ms": (
            "query",
            deadline,
            "Answer within this many ms of arrival. Required once: here, in X-Deadline-Ms, or in a JSON/form body.",
        ),
        "policy": (
            "query",
            {"type": "string", "enum": ["auto", "cascade", "static", "fixed"]},
            f"How to plan (default: {fields['policy'].default}).",
        ),
        "rung": ("query", {"type": "string"}, "The rung to run, with policy=fixed."),
        "on_infeasible": (
            "query",
            {"type": "string", "enum": ["reject", "best_effort"]},
            "reject: 503/504 when the deadline cannot be met; best_effort: answer anyway (default: "
            f"{fields['on_infeasible'].default}).",
        ),
        "top_k": (
            "query",
            {"type": "integer", "minimum": 1, "maximum": 100},
            f"How many classes to list (default: {fields['top_k'].default}).",
        ),
        "dtype": (
            "query",
            {"type": "string", "enum": ["uint8", "float32"]},
            "application/x-tensor bodies: element type.",
        ),
        "shape": (
            "query",
            {"type": "string", "example": "28,28"},
            "application/x-tensor bodies: comma-separated shape; uint8 (H,W) or (1,H,W) grey pixels, float32 the "
            "model's (C,H,W) input after preprocessing; the batch route takes a leading N.",
        ),
        "X-Deadline-Ms": ("header", deadline, "The deadline as a header (instead of deadline_ms)."),
    }
    for path in ("/v1/classify", "/v1/classify/batch"):
        parameters = app.openapi()["paths"][path]["post"]["parameters"]
        documented = {p["name"]: (p["in"], p["schema"], p["description"]) for p in parameters if p["name"] in expected}
        assert documented == expected, path
        assert all(p["required"] is False for p in parameters), path


ERROR_WORDS = {
    "400": "bad_image: the image cannot be decoded, or breaks a size limit",
    "404": "unknown_rung: policy=fixed names a rung the ladder does not have",
    "408": "body_timeout: the body did not arrive within the body timeout",
    "413": "payload_too_large: the body is over the size limit (refused before it is read when Content-Length says so)",
    "415": "unsupported_media_type: a content type this route does not take",
    "422": "invalid_request: an option is missing, malformed or given twice",
    "429": "queue_full: the queue is full (with Retry-After)",
    "500": "internal_error: a fault inside the server (its traceback is in the server's log)",
    "503": "deadline_infeasible (with fastest_ms), not_ready, shutting_down, overloaded, out_of_service or "
    "too_many_connections (with Retry-After); on /healthz worker_dead, on /readyz not_ready or load_failed",
    "504": "deadline_expired: the answer would only be ready after the deadline (with late_ms)",
}


def test_openapi_words_for_the_classify_routes_answers_errors_and_tensor_bodies(app: FastAPI) -> None:
    summaries = {
        "/v1/classify": "Classify one image within deadline_ms of its arrival; says which rung answered and if it was "
        "on time",
        "/v1/classify/batch": "Classify several images under one deadline; each is planned and may be batched with "
        "others",
    }
    for path, summary in summaries.items():
        operation = app.openapi()["paths"][path]["post"]
        assert operation["summary"] == summary
        assert operation["requestBody"]["content"]["application/x-tensor"] == {
            "schema": {
                "type": "string",
                "format": "binary",
                "description": "raw little-endian C-order elements; dtype and shape in the query",
            }
        }
        responses = operation["responses"]
        assert responses["200"]["description"] == "The answer"
    schemas = app.openapi()["components"]["schemas"]
    for model in ("ClassifyRequest", "BatchRequest", "ClassifyResponse", "BatchResponse", "ErrorBody", "Ladder"):
        assert schemas[model]["title"] == model and schemas[model]["properties"], model
        assert {status: r["description"] for status, r in responses.items() if status != "200"} == ERROR_WORDS


def test_openapi_documents_the_classify_routes_as_they_behave(app: FastAPI) -> None:
    spec = _get(app, "/openapi.json").json()
    assert app.openapi() is app.openapi()  # built once
    assert (spec["info"]["title"], spec["info"]["version"]) == ("Anytime", "0.1.0")
    schemas = spec["components"]["schemas"]
    assert {"ClassifyRequest", "BatchRequest", "ClassifyResponse", "BatchResponse", "ErrorBody", "Ladder"} <= set(
        schemas
    )
    for ref in _refs(spec):  # every reference resolves, the models' nested ones included
        assert ref.startswith("#/components/schemas/") and ref.removeprefix("#/components/schemas/") in schemas, ref
    assert "securitySchemes" not in spec["components"]
    fields = ClassifyOptions.model_fields
    bounds = {m.__class__.__name__: m for m in fields["deadline_ms"].metadata}
    top_k = {m.__class__.__name__: m for m in fields["top_k"].metadata}
    for path, operation_id, request, response, file, binary in (
        (
            "/v1/classify",
            "classify",
            "ClassifyRequest",
            "ClassifyResponse",
            {"type": "string", "format": "binary"},
            True,
        ),
        (
            "/v1/classify/batch",
            "classify_batch",
            "BatchRequest",
            "BatchResponse",
            {"type": "array", "items": {"type": "string", "format": "binary"}},
            False,
        ),
    ):
        post = spec["paths"][path]["post"]
        assert (post["operationId"], post["tags"], post["summary"] != "") == (operation_id, ["classify"], True)
        assert "security" not in post
        params = {p["name"]: p for p in post["parameters"]}
        assert list(params) == [*fields.keys(), "dtype", "shape", "X-Deadline-Ms", "X-Request-ID"]
        assert all(p["required"] is False and p["description"] for p in params.values())
        assert {n: p["in"] for n, p in params.items()} == {
            **dict.fromkeys([*fields.keys(), "dtype", "shape"], "query"),
            "X-Deadline-Ms": "header",
            "X-Request-ID": "header",
        }
        deadline = {"type": "number", "minimum": bounds["Ge"].ge, "maximum": bounds["Le"].le}
        assert params["deadline_ms"]["schema"] == params["X-Deadline-Ms"]["schema"] == deadline
        assert params["top_k"]["schema"] == {"type": "integer", "minimum": top_k["Ge"].ge, "maximum": top_k["Le"].le}
        assert params["policy"]["schema"] == {"type": "string", "enum": [str(p) for p in Policy]}
        assert params["on_infeasible"]["schema"] == {"type": "string", "enum": [str(o) for o in OnInfeasible]}
        assert params["rung"]["schema"] == params["X-Request-ID"]["schema"] == {"type": "string"}
        assert params["dtype"]["schema"] == {"type": "string", "enum": list(TENSOR_DTYPES)}
        assert parse_shape(params["shape"]["schema"]["example"]) == (28, 28)
        body = post["requestBody"]
        assert body["required"] is True
        forms = {"application/json", "multipart/form-data", "application/x-tensor"}
        assert set(body["content"]) == forms | (
            {"image/png", "image/jpeg", "application/octet-stream"} if binary else set()
        )
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{request}"}
        form = body["content"]["multipart/form-data"]["schema"]
        assert (form["type"], form["required"]) == ("object", ["file"])
        assert form["properties"] == {
            "file": file,
            "deadline_ms": {"type": "number"},
            "policy": {"type": "string"},
            "rung": {"type": "string"},
            "on_infeasible": {"type": "string"},
            "top_k": {"type": "integer"},
        }
        for media, content in body["content"].items():
            if media not in ("application/json", "multipart/form-data"):
                assert (content["schema"]["type"], content["schema"]["format"]) == ("string", "binary"), media
        ok = post["responses"]["200"]
        assert ok["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert ok["headers"]["X-Request-ID"]["schema"] == {"type": "string"} and ok["description"]
        statuses = {400, 404, 408, 413, 415, 422, 429, 500, 503, 504}
        assert set(post["responses"]) == {"200", *map(str, statuses)}  # no 401: no API key is set
        codes = _errors_by_status()
        for status in statuses:
            doc = post["responses"][str(status)]
            assert doc["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
            assert doc["headers"]["X-Request-ID"]["schema"] == {"type": "string"}
            assert any(doc["description"].startswith(c) for c in codes[status]), (status, doc["description"])
            missing = [c for c in codes[status] if c not in doc["description"]]
            assert not missing, (status, missing)


def test_openapi_describes_metrics_the_ladder_errors_and_the_request_id_in_words(app: FastAPI) -> None:
    paths = app.openapi()["paths"]
    ok = paths["/metrics"]["get"]["responses"]["200"]
    assert ok == {
        "description": "Prometheus text format 0.0.4",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    ladder = paths["/v1/ladder"]["get"]["responses"]
    assert ladder["200"]["description"] == "The ladder manifest"
    health = paths["/healthz"]["get"]
    assert health["responses"]["503"]["description"] == (
        "deadline_infeasible (with fastest_ms), not_ready, shutting_down, overloaded, out_of_service or "
        "too_many_connections (with Retry-After); on /healthz worker_dead, on /readyz not_ready or load_failed"
    )
    assert health["responses"]["413"]["headers"] == {
        "X-Request-ID": {"description": "the request's id", "schema": {"type": "string"}}
    }
    assert [p for p in health["parameters"] if p["name"] == "X-Request-ID"] == [
        {
            "name": "X-Request-ID",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "Names the request in logs and answers (1-128 of A-Z a-z 0-9 . _ : / + = -); "
            "else one is made.",
        }
    ]


UNAUTHORIZED = "unauthorized: an API key is set (ANYTIME_API_KEY) and the request lacks `Authorization: Bearer <key>`"


def test_openapi_documents_every_route_s_errors_and_the_key_where_it_is_needed(ladder_dir: Path) -> None:
    spec = _get(create_app(Settings(ladder=ladder_dir)), "/openapi.json").json()
    tags = {"/healthz": "health", "/readyz": "health", "/metrics": "health", "/v1/ladder": "ladder"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert operation["tags"] == [tags.get(path, "classify")], (path, method)
            assert all(r["description"] for r in operation["responses"].values()), (path, method)  # OpenAPI needs one
            names = [p["name"] for p in operation["parameters"]]
            assert names.count("X-Request-ID") == 1, (path, method)
            assert {"413", "500", "503"} <= set(operation["responses"]), (path, method)
            assert "401" not in operation["responses"] and "security" not in operation, (path, method)
    assert {path: set(ops["get"]["responses"]) for path, ops in spec["paths"].items() if "get" in ops} == {
        "/healthz": {"200", "413", "500", "503"},
        "/readyz": {"200", "413", "500", "503"},
        "/metrics": {"200", "413", "500", "503"},
        "/v1/ladder": {"200", "413", "500", "503"},
    }
    ladder = spec["paths"]["/v1/ladder"]["get"]["responses"]["200"]["content"]
    assert ladder == {"application/json": {"schema": {"$ref": "#/components/schemas/Ladder"}}}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert metrics == {"text/plain": {"schema": {"type": "string"}}}
    ready = spec["paths"]["/readyz"]["get"]["responses"]
    assert ready["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ReadyBody"}
    health = spec["paths"]["/healthz"]["get"]["responses"]["503"]
    assert health["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert "worker_dead" in health["description"]
    keyed = _get(create_app(Settings(ladder=ladder_dir, api_key="k" * 16)), "/openapi.json").json()
    assert keyed["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in keyed["paths"].items():
        for operation in operations.values():
            protected = path.startswith("/v1/")
            assert (operation.get("security") == [{"bearer": []}]) is protected, path
            assert ("401" in operation["responses"]) is protected, path
            if protected:
                assert operation["responses"]["401"]["description"] == UNAUTHORIZED


def test_a_job_finished_on_the_event_loop_resolves_its_request_at_once() -> None:
    """An inline run finishes on the loop's own thread: its request goes on without a round trip through the loop;
    a request of two images waits for both, the second finished on another thread."""

    async def scenario() -> tuple[bool, bool, bool]:
        one = classify._Waiter(asyncio.get_running_loop(), 1)
        one.job_done(None)  # type: ignore[arg-type]
        at_once = one.future.done()
        two = classify._Waiter(asyncio.get_running_loop(), 2)
        two.job_done(None)  # type: ignore[arg-type]
        half = two.future.done()
        await asyncio.to_thread(two.job_done, None)
        await asyncio.sleep(0)
        return at_once, half, two.future.done()

    assert asyncio.run(scenario()) == (True, False, True)


def test_the_classify_routes_come_first_and_fastapi_telemetry_is_off_unless_asked(ladder_dir: Path) -> None:
    """In process, side by side (2026-11-25): FastAPI's native telemetry asked the OpenTelemetry providers on every
    request and the classify routes were matched after the four docs routes: 238 against 220 us a request."""
    quiet, traced = create_app(Settings(ladder=ladder_dir)), create_app(Settings(ladder=ladder_dir, otel=True))
    assert [r.path for r in quiet.router.routes[:2]] == ["/v1/classify", "/v1/classify/batch"]  # type: ignore[attr-defined]
    assert not any(quiet._telemetry[k] for k in ("tracing", "metrics", "logs"))  # type: ignore[literal-required]
    assert all(traced._telemetry[k] for k in ("tracing", "metrics", "logs"))  # type: ignore[literal-required]
