"""The service on the real default ladder: planning, cascade behaviour, load, bad input, health, metrics."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from engines.base import entropy
from engines.factory import open_engine
from engines.manifest import Ladder
from loadtest.harness import png_base64, running_server
from loadtest.http import server_timing
from models.data import FashionMNIST
from service.app import create_app
from service.config import Settings
from service.planner import OnInfeasible, Planner, Policy
from service.predictor import LatencyPredictor
from tests.conftest import last_exit

pytestmark = pytest.mark.slow


# The planner's safety margin for this module's server: 1 ms, so that a 1 ms deadline is infeasible for every
# rung, even the tiny ladder's 0.05 ms ones.
MARGIN_MS = 1.0


@pytest.fixture(scope="module")
def server(ladder_dir: Path) -> Iterator[str]:
    with running_server(ladder_dir, ANYTIME_SAFETY_MARGIN_MS=str(MARGIN_MS)) as url:
        yield url


@pytest.fixture(scope="module")
def test_images(fmnist: FashionMNIST) -> tuple[np.ndarray, np.ndarray]:
    split = fmnist.split("test").head(400)
    return split.images, split.labels


def _classify(client: httpx.Client, image: np.ndarray, deadline_ms: float, **options: object) -> httpx.Response:
    return client.post("/v1/classify", json={"image": png_base64(image), "deadline_ms": deadline_ms, **options})


def _phases(response: httpx.Response) -> dict[str, float]:
    """The answer's Server-Timing: each phase's ms, in the order the server gave them."""
    return server_timing(response.headers["server-timing"])


def _phase_ms(response: httpx.Response, phase: str) -> float:
    return _phases(response)[phase]


def test_loose_deadline_gets_the_most_accurate_answer(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    body = _classify(client, test_images[0][0], 5000, policy="static").json()
    answers = [*ladder.rungs, *ladder.ensembles]  # ensembles are rungs too
    best = max((r for r in answers if not r.dominated), key=lambda r: r.val_accuracy)
    assert body["rung"] == best.name and body["deadline_met"]
    last = last_exit(ladder)
    body = _classify(client, test_images[0][0], 5000, policy="fixed", rung=last.name).json()
    assert body["exit"] == last.exit and body["precision"] == "fp32" and body["deadline_met"]


def test_tight_deadline_gets_a_fast_rung_on_time(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    margin = MARGIN_MS
    candidates = [r for r in [*ladder.rungs, *ladder.ensembles] if not r.dominated]
    # Planning: a deadline the most accurate rung cannot meet goes to a faster one.
    best = max(candidates, key=lambda r: r.val_accuracy)
    planner = Planner(ladder, LatencyPredictor([*ladder.rungs, *ladder.ensembles]), margin)
    plan = planner.plan(Policy.STATIC, best.profile(1).p99_ms + margin - 0.01, 0.0, OnInfeasible.REJECT)
    assert {r.name: r for r in candidates}[plan.name].profile(1).p99_ms < best.profile(1).p99_ms
    # Over HTTP: at the tightest deadline the fastest rung meets, answers come on time from rungs that fit it.
    # That deadline is what the server says the fastest plan needs now (its refusal of a 1 ms deadline names it:
    # queue, engine and margin, on its live estimates), plus the time a request spends on this server before it
    # is planned (parse, decode: bounded by the answer's `latency_ms` less the `run` phase of its Server-Timing),
    # measured here: the most of 20 loose requests. Not the ladder's profile: a lone run in the server takes about
    # twice a run of the builder's back-to-back loop on this ladder, and a cached tiny ladder's profile may be a
    # day old (docs/measurements.md, "The tight-deadline test failed in CI"). Asked before each request, since
    # every answer adds to the estimates.
    fastest = min(candidates, key=lambda r: r.profile(1).p99_ms)
    loose = [_classify(client, test_images[0][i], 5000, policy="fixed", rung=fastest.name) for i in range(20)]
    path_ms = max(r.json()["latency_ms"] - _phase_ms(r, "run") for r in loose)
    answered = []
    for i in range(20):
        probe = _classify(client, test_images[0][i], 1, policy="static")
        assert probe.status_code == 503 and probe.json()["code"] == "deadline_infeasible", probe.json()
        deadline = probe.json()["fastest_ms"] + path_ms
        answered.append(_classify(client, test_images[0][i], deadline, policy="static"))
    ok = [r.json() for r in answered if r.status_code == 200]
    assert len(ok) >= 17, [r.json() for r in answered if r.status_code != 200][:3]
    assert all(b["deadline_met"] and b["latency_ms"] <= b["deadline_ms"] for b in ok)
    # The fastest rung, or one whose profile fits (a rung the server has not run lately is planned on its profile,
    # scaled by the machine's slowdown, never below 1).
    profiled = {r.name: r.profile(1).p99_ms for r in candidates}
    fit = [b["rung"] == fastest.name or profiled[b["rung"]] + margin <= b["deadline_ms"] for b in ok]
    assert all(fit), [(b["rung"], b["deadline_ms"]) for b in ok]


def test_impossible_deadline_is_refused_at_once(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    slowest = max(ladder.rungs, key=lambda r: r.profile(1).p99_ms)
    assert slowest.profile(1).p99_ms + MARGIN_MS > 1  # no plan for it fits in 1 ms
    response = _classify(client, test_images[0][0], 1, policy="fixed", rung=slowest.name)
    assert response.status_code == 503 and response.json()["code"] == "deadline_infeasible"
    assert response.json()["fastest_ms"] > 1
    # At once: refused as soon as its options were read, before its image was decoded or any engine ran (its
    # Server-Timing phases; a bound in ms would be a guess on a machine that stalls for 100 ms at a time).
    phases = list(_phases(response))
    assert phases == ["loop", "receive", "parse", "validate", "app"], phases


def test_best_effort_answers_late_and_says_so(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    """No plan fits 1 ms (its p99 plus this server's 1 ms margin): best effort answers anyway, and says whether
    the answer was in time (on the tiny ladder it may be: the margin, not the rung, made the plan infeasible)."""
    slowest = max(ladder.rungs, key=lambda r: r.profile(1).p99_ms)
    assert slowest.profile(1).p99_ms + MARGIN_MS > 1
    response = _classify(client, test_images[0][0], 1, policy="fixed", rung=slowest.name, on_infeasible="best_effort")
    body = response.json()
    assert response.status_code == 200 and body["rung"] == slowest.name
    assert body["deadline_met"] is (body["latency_ms"] <= body["deadline_ms"] == 1)


def test_cascade_stops_on_confident_exits(
    client: httpx.Client, ladder: Ladder, ladder_dir: Path, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    first = _classify(client, test_images[0][0], 5000, policy="cascade").json()
    cascade = next(c for c in ladder.cascades if c.name == first["rung"])
    stage1 = ladder.stage(cascade.stages[0])
    engine = open_engine(stage1.backend, ladder_dir / stage1.artifact.path, stage1.precision)
    from models.data import PreprocessSpec

    spec = PreprocessSpec.from_dict(ladder.preprocess)
    # Easy and hard images, chosen by their exit-1 entropy: a ladder may stop 97 % of images at exit 1 (the
    # tiny one does), so 60 images in test order can all be easy. The 30 least and 30 most uncertain of 400:
    order = np.argsort(entropy(engine.run(spec.normalize(test_images[0]))[1]))
    images = test_images[0][np.concatenate([order[:30], order[-30:]])]
    bodies = [_classify(client, img, 5000, policy="cascade").json() for img in images]
    ent1 = entropy(engine.run(spec.normalize(images))[1])
    stages = np.array([b["stages_run"] for b in bodies])
    assert (stages == 1).any() and (stages > 1).any()  # easy ones stop, hard ones go deeper
    assert np.all(ent1[stages == 1] <= cascade.thresholds[0] + 1e-3)
    assert np.all(ent1[stages > 1] > cascade.thresholds[0] - 1e-3)
    assert np.mean(ent1[stages == 1]) < np.mean(ent1[stages > 1])


def test_concurrent_mixed_deadlines_all_answered(ladder_dir: Path, test_images: tuple[np.ndarray, np.ndarray]) -> None:
    """Every request is answered, on time or with an explicit error; the loose ones are all served.

    Eight closed-loop clients in this process oversubscribe the two cores: engine runs then take 2-5x their
    profiled p99, so some answers are ready only after their deadline and go out as 504s (11-27 of 400 measured,
    see LatencyPredictor).
    """
    with running_server(ladder_dir) as server:
        _concurrent_run(server, test_images)


def _concurrent_run(server: str, test_images: tuple[np.ndarray, np.ndarray]) -> None:
    rng = np.random.default_rng(0)
    deadlines = rng.choice([1, 2, 5, 10, 50], size=400)
    policies = rng.choice(["cascade", "static"], size=400)
    payloads = [
        {"image": png_base64(test_images[0][i]), "deadline_ms": float(deadlines[i]), "policy": policies[i]}
        for i in range(400)
    ]

    def client_loop(shard: list[dict[str, object]]) -> list[httpx.Response]:
        with httpx.Client(base_url=server, timeout=30) as c:  # one connection per client, reused
            return [c.post("/v1/classify", json=p) for p in shard]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        shards = list(pool.map(client_loop, [payloads[i::8] for i in range(8)]))
    results = [shards[i % 8][i // 8] for i in range(400)]  # back in payload order
    assert len(results) == 400
    statuses = {r.status_code for r in results}
    assert statuses <= {200, 429, 503, 504}, statuses
    late = 0
    for r in results:
        body = r.json()
        if r.status_code == 200:
            assert body["deadline_met"] is True and 0 < body["latency_ms"] <= body["deadline_ms"]
        else:
            # Not "overloaded": eight clients that wait for their answers have at most eight requests in flight,
            # at the shedding floor (ANYTIME_SHED_MIN_CONNECTIONS, 8); before it, 2-11 % of 50 ms requests were shed.
            assert body["code"] in {"queue_full", "deadline_infeasible", "deadline_expired"}, body
            late += "late_ms" in body
    assert late <= 60, f"{late} of 400 answers were ready only after their deadline"
    loose = [r.status_code for p, r in zip(payloads, results, strict=True) if p["deadline_ms"] == 50]
    assert loose.count(200) >= 0.9 * len(loose), loose  # 50 ms is ample even under this load


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("request_kwargs", "status", "code"),
    [
        ({"json": {"image": "not base64!", "deadline_ms": 50}}, 400, "bad_image"),
        ({"json": {"image": base64.b64encode(b"GIF89a....").decode(), "deadline_ms": 50}}, 400, "bad_image"),
        ({"json": {"image": [[1, 2], [3]], "deadline_ms": 50}}, 400, "bad_image"),
        ({"json": {"image": [[1000]], "deadline_ms": 50}}, 400, "bad_image"),
        ({"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        (
            {"content": b"x" * (5 * 1024 * 1024), "headers": {"content-type": "application/json"}},
            413,
            "payload_too_large",
        ),
        ({"json": {"image": "AAAA"}}, 422, "invalid_request"),
        ({"json": {"image": "AAAA", "deadline_ms": 0}}, 422, "invalid_request"),
        ({"json": {"image": "AAAA", "deadline_ms": 70000}}, 422, "invalid_request"),
        ({"json": {"image": "AAAA", "deadline_ms": 5, "policy": "fastest"}}, 422, "invalid_request"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "invalid_request"),
        ({"files": {"nofile": ("a.png", b"x")}, "data": {"deadline_ms": "5"}}, 422, "invalid_request"),
        ({"files": {"file": ("a.png", b"not an image")}, "data": {"deadline_ms": "50"}}, 400, "bad_image"),
    ],
)
def test_bad_input_gets_its_status_and_code(client: httpx.Client, request_kwargs: dict, status: int, code: str) -> None:
    response = client.post("/v1/classify", **request_kwargs)
    assert response.status_code == status, response.text
    assert response.json()["code"] == code and response.json()["message"]


def test_unknown_rung_is_404(client: httpx.Client) -> None:
    r = client.post(
        "/v1/classify",
        json={
            "image": base64.b64encode(_png_bytes()).decode(),
            "deadline_ms": 50,
            "policy": "fixed",
            "rung": "exit9.int4.magic",
        },
    )
    assert r.status_code == 404 and r.json()["code"] == "unknown_rung"
    assert client.get("/v1/nothing").json()["code"] == "not_found"


def test_multipart_upload_and_resize(client: httpx.Client) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 40, 3), 200, np.uint8)).save(buf, "JPEG")
    r = client.post(
        "/v1/classify",
        files={"file": ("x.jpg", buf.getvalue(), "image/jpeg")},
        data={"deadline_ms": "100", "top_k": "3"},
    )
    assert r.status_code == 200 and r.json()["resized"] is True and len(r.json()["top_k"]) == 3


def test_batch_form(client: httpx.Client, test_images: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = test_images
    r = client.post("/v1/classify/batch", json={"images": [png_base64(im) for im in images[:16]], "deadline_ms": 200})
    results = r.json()["results"]
    assert r.status_code == 200 and len(results) == 16
    rung = results[0]["rung"]
    assert {res["rung"] for res in results} == {rung}  # one plan for the batch
    alone = [_classify(client, im, 5000, policy="fixed", rung=rung).json()["label"] for im in images[:16]]
    assert [res["label"] for res in results] == alone  # each answer is its own image's, in order
    assert sum(a == int(y) for a, y in zip(alone, labels[:16], strict=True)) >= 8  # and mostly right


def test_ladder_endpoint_and_docs(client: httpx.Client, ladder: Ladder) -> None:
    body = client.get("/v1/ladder").json()
    assert [r["name"] for r in body["rungs"]] == [r.name for r in ladder.rungs]
    assert body["cascades"][0]["thresholds"]
    assert client.get("/docs").status_code == 200
    assert "/v1/classify" in client.get("/openapi.json").json()["paths"]


def test_metrics_parse_as_prometheus(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "anytime_requests",
        "anytime_latency_ms",
        "anytime_queue_depth",
        "anytime_prediction_error_ms",
        "anytime_batch_size",
        "anytime_exit",
        "anytime_deadline_misses",
    } <= names


def test_readyz_is_503_until_warm(ladder_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the engines load, /readyz and /v1/classify answer 503 not_ready; after, 200 and a real answer."""
    from service.runtime import Runtime

    gate = threading.Event()
    real_open = Runtime._open

    def held_open(self: Runtime, name: str) -> None:
        assert gate.wait(60)
        real_open(self, name)

    monkeypatch.setattr(Runtime, "_open", held_open)
    app = create_app(Settings(ladder=ladder_dir))
    image = base64.b64encode(_png_bytes()).decode()
    with TestClient(app) as c:
        first = c.get("/readyz")
        assert c.get("/healthz").status_code == 200
        early = c.post("/v1/classify", json={"image": image, "deadline_ms": 50})
        gate.set()
        deadline = time.monotonic() + 120
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = c.get("/readyz")
        late = c.post("/v1/classify", json={"image": image, "deadline_ms": 5000})
    assert first.status_code == 503 and first.json()["code"] == "not_ready" and first.headers["retry-after"]
    assert early.status_code == 503 and early.json()["code"] == "not_ready"
    assert ready.status_code == 200 and late.status_code == 200 and late.json()["deadline_met"]


def test_auto_is_the_default_and_dominated_rungs_load_only_when_named(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    body = _classify(client, test_images[0][1], 5000).json()
    assert body["policy"] == "auto" and body["deadline_met"]
    in_cascades = {m for c in ladder.member_cascades if not c.dominated for m in c.members}
    dominated = [r for r in ladder.rungs if r.dominated and r.name not in in_cascades]  # served by no plan
    assert dominated, "the ladder has dominated rungs"
    loaded = client.get("/readyz").json()["engines"]
    assert loaded < len(ladder.rungs) + len(ladder.stages) + len(ladder.ensembles)
    named = min(dominated, key=lambda r: r.profile(1).p99_ms)  # not one another test names (the slowest)
    body = _classify(client, test_images[0][1], 5000, policy="fixed", rung=named.name).json()
    assert body["rung"] == named.name and body["deadline_met"]  # loaded on first use, then answered
    assert client.get("/readyz").json()["engines"] == loaded + 1


def test_a_member_cascade_answers_through_the_server(
    client: httpx.Client, ladder: Ladder, test_images: tuple[np.ndarray, np.ndarray]
) -> None:
    """Named with `fixed`, a member cascade runs its members in order and combines them; the answer names the
    members that ran (the first always, the others only when the answer so far was not confident)."""
    cascade = ladder.member_cascades[0]
    bodies = [_classify(client, image, 5000, policy="fixed", rung=cascade.name).json() for image in test_images[0][:40]]
    assert all(b["rung"] == cascade.name and b["deadline_met"] for b in bodies), bodies[0]
    ran = [b["members"] for b in bodies]
    assert all(r == cascade.members[: len(r)] and len(r) >= 1 for r in ran)
    assert {len(r) for r in ran} - {1}, "some answers were unsure enough to call in the next member"
