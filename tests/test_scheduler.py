"""Scheduler logic with fake engines (sleep-based): EDF at stage granularity, batching, expiry, cancel."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engines.base import Backend, EngineBase, Precision
from engines.manifest import Artifact, Cascade, Ladder, LatencyProfile, Rung, Stage
from service.errors import DeadlineExpired, QueueFull
from service.planner import OnInfeasible, Plan, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Job, Scheduler

STAGE_MS = 20.0


class SleepEngine(EngineBase):
    backend, precision, input_name, output_names = Backend.TORCH, Precision.FP32, "x", ["features", "logits"]
    input_shape = (4,)

    def __init__(self, ms: float, unsure: bool = True) -> None:
        self.ms, self.unsure = ms, unsure
        self.batches: list[int] = []
        self.gate = threading.Event()  # cleared by a test to hold the worker inside run()
        self.gate.set()

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        self.batches.append(len(x))
        assert self.gate.wait(5)
        time.sleep(self.ms / 1e3)
        logits = np.zeros((len(x), 10), np.float32) if self.unsure else np.eye(10, dtype=np.float32)[[0] * len(x)] * 50
        return [x, logits]


def _record(cls, name: str, ms: float, **extra):  # type: ignore[no-untyped-def]
    profiles = [LatencyProfile(batch=b, p50_ms=ms, p90_ms=ms, p99_ms=ms * 1.1, runs=200) for b in (1, 8, 32)]
    return cls(
        name=name,
        precision=Precision.FP32,
        backend=Backend.TORCH,
        artifact=Artifact(path=name, sha256="0", bytes=1),
        input_shape=[4],
        outputs=["features", "logits"],
        profiles=profiles,
        macs=1,
        peak_memory_bytes=0,
        **extra,
    )


def _ladder() -> Ladder:
    stages = [_record(Stage, f"s{k}", STAGE_MS, index=k) for k in (1, 2, 3)]
    rung = _record(Rung, "fast", 1.0, kind="exit", exit=1, val_accuracy=0.8, test_accuracy=0.8)
    cascade = Cascade(
        name="cascade",
        precision=Precision.FP32,
        backend=Backend.TORCH,
        stages=["s1", "s2", "s3"],
        thresholds=[0.1, 0.1],
        accuracy_bound_pp=0.5,
        expected_exit_share=[0, 0, 1],
        expected_mean_ms=60,
        val_accuracy=0.9,
        test_accuracy=0.9,
        test_last_exit_accuracy=0.9,
    )
    return Ladder.model_construct(rungs=[rung], stages=stages, cascades=[cascade])


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {
        "s1": SleepEngine(STAGE_MS),
        "s2": SleepEngine(STAGE_MS),
        "s3": SleepEngine(STAGE_MS),
        "fast": SleepEngine(1.0, unsure=False),
    }
    scheduler = Scheduler(engines, planner, predictor, max_queue=8, max_batch=4, batch_window_ms=0, margin_ms=1.0)
    scheduler.start()
    yield scheduler, planner, engines
    scheduler.stop()


def _job(
    planner: Planner,
    policy: Policy,
    deadline_ms: float,
    done: list[Job],
    event: threading.Event | None = None,
    on_infeasible: OnInfeasible = OnInfeasible.REJECT,
) -> Job:
    now = time.monotonic()
    plan = planner.plan(policy, deadline_ms, 0.0, on_infeasible)

    def finish(job: Job) -> None:
        done.append(job)
        if event is not None:
            event.set()

    return Job(str(len(done)), now, now + deadline_ms / 1e3, np.zeros((1, 4), np.float32), plan, finish)


def test_urgent_request_overtakes_queued_cascades(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = setup
    done: list[Job] = []
    slow = [_job(planner, Policy.CASCADE, 5000, done) for _ in range(3)]
    for job in slow:
        scheduler.submit(job)
    time.sleep(STAGE_MS * 1.5 / 1e3)  # the cascades are under way
    urgent_done = threading.Event()
    urgent = _job(planner, Policy.STATIC, 3 * STAGE_MS, done, urgent_done)
    scheduler.submit(urgent)
    assert urgent_done.wait(2)
    assert urgent.error is None and urgent.finished <= urgent.deadline
    # It answered while the cascades were still mid-way: none of them had run all three stages yet.
    assert all(j.step < 3 for j in slow)
    deadline = time.monotonic() + 5
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(j.step for j in slow) == [3, 3, 3]


def test_same_stage_items_are_batched(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    blocker = _job(planner, Policy.CASCADE, 5000, done)
    scheduler.submit(blocker)
    while blocker.started is None:
        time.sleep(0.0005)
    for _ in range(3):
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
    deadline = time.monotonic() + 5
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert max(engines["s1"].batches) == 3  # the three that queued behind the first ran as one batch


def test_cascade_stops_early_when_time_runs_out(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = setup
    done: list[Job] = []
    event = threading.Event()
    job = _job(planner, Policy.CASCADE, 2.5 * STAGE_MS, done, event)  # room for two stages, not three
    assert job.plan.name == "cascade"
    scheduler.submit(job)
    assert event.wait(2)
    assert job.error is None and 1 <= job.step < 3 and job.finished <= job.deadline


def test_expired_before_running_gets_504(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = setup
    done: list[Job] = []
    blocker = _job(planner, Policy.CASCADE, 5000, done)
    scheduler.submit(blocker)  # occupies the worker
    while blocker.started is None:
        time.sleep(0.0005)
    event = threading.Event()
    late = _job(planner, Policy.STATIC, 5, done, event)
    scheduler.submit(late)
    assert event.wait(2)
    assert isinstance(late.error, DeadlineExpired) and late.step == 0


def test_cancelled_work_is_dropped_and_queue_bound_holds(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    jobs = [_job(planner, Policy.CASCADE, 5000, done) for _ in range(8)]
    engines["s1"].gate.clear()  # the first job holds the worker until the others are queued and cancelled
    scheduler.submit(jobs[0])
    while jobs[0].started is None:
        time.sleep(0.0005)
    for job in jobs[1:]:
        scheduler.submit(job)
    with pytest.raises(QueueFull) as e:
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
    assert e.value.headers["Retry-After"]
    for job in jobs[1:]:
        scheduler.cancel(job)
    engines["s1"].gate.set()
    deadline = time.monotonic() + 5
    while len(done) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 8 and all(j.cancelled and j.step == 0 for j in jobs[1:])  # answered, never run
    assert jobs[0].step == 3 and not jobs[0].cancelled


def test_queued_work_that_no_longer_fits_is_settled_without_running_late(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = setup
    scheduler.stop()  # no worker: the test takes batches itself
    done: list[Job] = []
    # A cascade mid-way whose next stage (22 ms predicted) no longer fits in the 10 ms left: answers with exit 1.
    cascade = _job(planner, Policy.CASCADE, 5000, done)
    cascade.deadline, cascade.step, cascade.logits = time.monotonic() + 0.010, 1, np.zeros((1, 10), np.float32)
    # A queued job with no answer yet, planned on a rung that no longer fits: moves to one that does.
    moved = _job(planner, Policy.STATIC, 5000, done)
    moved.plan, moved.deadline = Plan(Policy.STATIC, "s1", ["s1"]), time.monotonic() + 0.010
    # No plan fits at all: 504 at once instead of a late answer.
    hopeless = _job(planner, Policy.CASCADE, 5000, done)
    hopeless.deadline = time.monotonic() + 0.0015
    for job in (cascade, moved, hopeless):
        scheduler.submit(job)
    with scheduler._cond:
        batch = scheduler._take_batch()
    assert batch == [moved] and moved.plan.engines == ["fast"]
    assert cascade in done and cascade.error is None and cascade.step == 1
    assert hopeless in done and isinstance(hopeless.error, DeadlineExpired) and hopeless.step == 0


def test_infeasible_plan_rejected_or_best_effort() -> None:
    ladder = _ladder()
    planner = Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0)
    from service.errors import DeadlineInfeasible

    with pytest.raises(DeadlineInfeasible) as e:
        planner.plan(Policy.STATIC, 0.5, 0.0, OnInfeasible.REJECT)
    assert e.value.extra["fastest_ms"] == pytest.approx(2.1)
    plan = planner.plan(Policy.STATIC, 0.5, 0.0, OnInfeasible.BEST_EFFORT)
    assert not plan.feasible and plan.name == "fast"
    assert isinstance(plan, Plan)


def test_predictor_moves_from_prior_to_observed() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs], window=50)
    assert predictor.predict("s1", 1) == pytest.approx(22.0)
    assert predictor.predict("s1", 4) == pytest.approx(22.0)  # interpolated between equal profiles
    for _ in range(20):
        predictor.observe("s1", 1, 5.0)
    assert predictor.predict("s1", 1) == pytest.approx(5.0)
