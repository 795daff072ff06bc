"""Scheduler logic with fake engines (sleep-based): EDF at stage granularity, batching, expiry, cancel, inline runs."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from engines.base import Backend, EngineBase, Precision
from engines.manifest import Artifact, Cascade, Ladder, LatencyProfile, MemberCascade, Rung, Stage, pack_right
from service.caution import Caution
from service.errors import (
    DeadlineExpired,
    DeadlineInfeasible,
    InternalError,
    OutOfService,
    QueueFull,
    ShuttingDown,
    UnknownRung,
)
from service.load import ArrivalRate, Budget
from service.planner import OnInfeasible, Plan, PlanKind, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Job, Scheduler

STAGE_MS = 20.0


class SleepEngine(EngineBase):
    backend, precision, input_name, output_names = Backend.TORCH, Precision.FP32, "x", ["features", "logits"]
    input_shape = (4,)
    concurrent = True

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


def _setup():  # type: ignore[no-untyped-def]
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {
        "s1": SleepEngine(STAGE_MS),
        "s2": SleepEngine(STAGE_MS),
        "s3": SleepEngine(STAGE_MS),
        "fast": SleepEngine(1.0, unsure=False),
    }
    scheduler = Scheduler(engines, planner, predictor, max_queue=8, max_batch=4, margin_ms=1.0, inline_max_ms=2.0)
    return scheduler, planner, engines


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    scheduler, planner, engines = _setup()
    scheduler.start()
    yield scheduler, planner, engines
    scheduler.stop()


@pytest.fixture
def no_worker():  # type: ignore[no-untyped-def]
    """A scheduler whose worker never starts: the test takes batches itself."""
    return _setup()


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

    best_effort = on_infeasible is OnInfeasible.BEST_EFFORT
    return Job(str(len(done)), now, now + deadline_ms / 1e3, np.zeros((1, 4), np.float32), plan, finish, best_effort)


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


def _occupy_worker(scheduler: Scheduler, planner: Planner, done: list[Job]) -> Job:
    """Submit a long cascade job and wait until the worker has started it: what is submitted next queues."""
    blocker = _job(planner, Policy.CASCADE, 5000, done)
    scheduler.submit(blocker)
    while blocker.started is None:
        time.sleep(0.0005)
    return blocker


def _wait_until_done(done: list[Job], count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(done) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_same_stage_items_are_batched(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    _occupy_worker(scheduler, planner, done)
    for _ in range(3):
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
    _wait_until_done(done, 4)
    assert max(engines["s1"].batches) == 3  # the three that queued behind the first ran as one batch


def test_batches_stop_at_the_engines_cap() -> None:
    """A plan's profile ends at its max batch: the scheduler never hands it more, whatever max_batch allows."""
    scheduler, planner, engines = _setup()
    scheduler.batch_caps = {"s1": 2}
    assert (scheduler.batch_limit("s1"), scheduler.batch_limit("s2")) == (2, 4)
    scheduler.start()
    try:
        done: list[Job] = []
        _occupy_worker(scheduler, planner, done)
        for _ in range(5):
            scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
        _wait_until_done(done, 6)
        assert len(done) == 6 and all(j.error is None for j in done)
        # Five queued behind the first: without the cap they would have run as batches of max_batch (4).
        assert max(engines["s1"].batches) == 2 and sum(engines["s1"].batches) == 6
    finally:
        scheduler.stop()


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
    _occupy_worker(scheduler, planner, done)
    event = threading.Event()
    late = _job(planner, Policy.STATIC, 5, done, event)
    scheduler.submit(late)
    assert event.wait(2)
    assert isinstance(late.error, DeadlineExpired) and late.step == 0


def test_cancel_frees_the_queue_slot_at_once_and_answers_without_running(setup) -> None:  # type: ignore[no-untyped-def]
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
        assert scheduler.cancel(job)  # it was queued
    # The slots are free before the worker moves: a burst of disconnects does not refuse later clients.
    assert scheduler.depth() == 1 and scheduler.wait_ms(time.monotonic() + 10) < 2 * STAGE_MS
    late = _job(planner, Policy.CASCADE, 5000, done)
    scheduler.submit(late)
    assert not scheduler.cancel(jobs[0])  # running: it finishes its engine call, then stops
    engines["s1"].gate.set()
    deadline = time.monotonic() + 5
    while len(done) < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 9 and all(j.cancelled and j.step == 0 for j in jobs[1:])  # answered, never run
    assert jobs[0].step == 1 and late.step == 3 and scheduler.depth() == 0


def test_lone_quick_job_runs_inline_on_an_idle_scheduler(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    job = _job(planner, Policy.STATIC, 500, done)
    assert job.plan.engines == ["fast"]  # 1 ms <= inline_max_ms
    caller = threading.get_ident()
    seen: list[int] = []
    job.on_done = lambda j: seen.append(threading.get_ident())
    scheduler.submit(job, inline=True)
    assert job.finished is not None and seen == [caller]  # done before submit returned, on this thread
    assert engines["fast"].batches == [1] and scheduler.depth() == 0


def test_quick_work_runs_inline_beside_the_worker_and_slow_work_never_does(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    engines["s1"].gate.clear()  # holds the worker inside s1
    slow = _job(planner, Policy.STATIC, 5000, done)
    slow.plan = Plan(Policy.STATIC, "s1", ["s1"])  # 22 ms predicted: over inline_max_ms
    scheduler.submit(slow, inline=True)
    assert slow.finished is None  # went to the worker
    while slow.started is None:
        time.sleep(0.0005)
    queued = _job(planner, Policy.STATIC, 100, done)
    queued.plan = Plan(Policy.STATIC, "s1", ["s1"])
    scheduler.submit(queued)
    quick = _job(planner, Policy.STATIC, 5000, done)
    scheduler.submit(quick, inline=True)
    assert quick.finished is not None  # ran at once on this thread, beside the worker, not behind `queued`
    assert queued.finished is None
    engines["s1"].gate.set()
    deadline = time.monotonic() + 5
    while len(done) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [j.plan.engines[0] for j in done] == ["fast", "s1", "s1"] and engines["s1"].batches == [1, 1]


def test_drain_refuses_new_work_and_stop_answers_what_is_queued(setup) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, engines = setup
    done: list[Job] = []
    engines["s1"].gate.clear()
    first = _job(planner, Policy.CASCADE, 5000, done)
    scheduler.submit(first)
    while first.started is None:
        time.sleep(0.0005)
    queued = [_job(planner, Policy.CASCADE, 5000, done) for _ in range(3)]
    for job in queued:
        scheduler.submit(job)
    scheduler.drain()
    with pytest.raises(ShuttingDown):
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
    stopper = threading.Thread(target=scheduler.stop)
    stopper.start()
    deadline = time.monotonic() + 2
    while len(done) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(isinstance(j.error, ShuttingDown) for j in queued) and len(done) == 3  # answered, not dropped
    engines["s1"].gate.set()
    stopper.join(5)
    assert first.finished is not None and first.error is None and first.step == 1  # no further stage after stop


def test_best_effort_job_that_no_longer_fits_runs_instead_of_504(no_worker) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = no_worker
    done: list[Job] = []
    # The client asked for best effort; its plan was feasible when admitted but queueing ate the time.
    job = _job(planner, Policy.STATIC, 5000, done, on_infeasible=OnInfeasible.BEST_EFFORT)
    job.plan, job.deadline = Plan(Policy.STATIC, "s1", ["s1"]), time.monotonic() + 0.0005
    scheduler.submit(job)
    with scheduler._cond:
        batch = scheduler._take_batch()
    assert batch == [job] and job.error is None and job.plan.name == "fast" and not job.plan.feasible


def test_queued_work_that_no_longer_fits_is_settled_without_running_late(no_worker) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = no_worker
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


def test_policy_and_on_infeasible_names_are_the_apis() -> None:
    # The wire values of `policy` and `on_infeasible` (requests, answers, metrics labels, OpenAPI enums).
    assert [p.value for p in Policy] == ["auto", "cascade", "static", "fixed"]
    assert [o.value for o in OnInfeasible] == ["reject", "best_effort"]


def test_a_stage_cascade_without_recorded_depths_is_credited_only_whole() -> None:
    # An older manifest has no val_accuracy_by_depth: a shorter run still answers, but is worth nothing to auto.
    planner = _planner()
    assert planner.options["cascade"].accuracy_by_depth == [0.0, 0.0, 0.9]
    # Two stages fit but not three: auto takes the rung (0.8), not a partial cascade credited with nothing.
    assert planner.plan(Policy.AUTO, 2 * STAGE_MS * 1.1 + 2.0, 0.0, OnInfeasible.REJECT).name == "fast"


def _planner(ladder: Ladder | None = None) -> Planner:
    ladder = ladder or _ladder()
    return Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0)


def test_fits_and_depth_count_the_wait_every_engine_and_the_margin_up_to_the_boundary() -> None:
    planner, p99 = _planner(), 1.1  # the fake profiles' p99 is 1.1x the p50
    assert planner.fits(["fast"], time_left_ms=0.5 + p99 + 1.0, wait_ms=0.5)
    assert not planner.fits(["fast"], time_left_ms=0.5 + p99 + 1.0 - 0.01, wait_ms=0.5)
    assert not planner.fits(["fast", "fast"], time_left_ms=0.5 + p99 + 1.0, wait_ms=0.5)
    stage = STAGE_MS * p99
    cascade = planner.options["cascade"]
    assert [planner.depth_within(cascade, b) for b in (stage - 0.01, stage, 2 * stage, 3 * stage + 5)] == [0, 1, 2, 3]


def test_the_cascade_policy_takes_the_most_accurate_stage_cascade_that_fits_whole() -> None:
    ladder = _ladder()
    better = ladder.cascades[0].model_copy(update={"name": "better", "val_accuracy": 0.95})
    worse = ladder.cascades[0].model_copy(update={"name": "worse", "val_accuracy": 0.85})
    ladder.cascades = [worse, ladder.cascades[0], better]
    planner = _planner(ladder)
    assert planner.plan(Policy.CASCADE, 1000.0, 0.0, OnInfeasible.REJECT).name == "better"


def test_fixed_names_an_option_or_is_refused_with_the_reason() -> None:
    planner = _planner()
    assert set(planner.rungs) == {"fast", "cascade"}
    for name in (None, "nope"):
        with pytest.raises(UnknownRung) as refused:
            planner.plan(Policy.FIXED, 1000.0, 0.0, OnInfeasible.REJECT, name)
        assert refused.value.message == f"unknown rung {name!r}; see GET /v1/ladder for the rungs"
    planner.take_out("fast")
    with pytest.raises(OutOfService) as refused:
        planner.plan(Policy.FIXED, 1000.0, 0.0, OnInfeasible.REJECT, "fast")
    assert refused.value.message == "rung fast is out of service (its engine failed); another policy can answer"


def test_auto_breaks_a_tie_in_accuracy_for_the_cheaper_first_step_and_fits_up_to_the_boundary() -> None:
    cheap = _record(Rung, "cheap", 1.0, kind="exit", exit=1, val_accuracy=0.8, test_accuracy=0.8)
    dear = _record(Rung, "dear", 2.0, kind="exit", exit=1, val_accuracy=0.8, test_accuracy=0.8)
    for rungs in ([cheap, dear], [dear, cheap]):
        planner = _planner(Ladder.model_construct(rungs=rungs, stages=[], cascades=[]))
        assert planner.plan(Policy.AUTO, 1000.0, 0.0, OnInfeasible.REJECT).name == "cheap"
        assert planner.plan(Policy.AUTO, 1.1 + 1.0, 0.0, OnInfeasible.REJECT).name == "cheap"  # p99 + margin, exactly
        with pytest.raises(
            DeadlineInfeasible, match=r"within 2\.09 ms: the fastest needs about 2\.10 ms \(queue 0\.00"
        ):
            planner.plan(Policy.AUTO, 2.09, 0.0, OnInfeasible.REJECT)


def test_a_policy_whose_engines_all_failed_is_out_of_service() -> None:
    planner = _planner()
    planner.take_out("s1")
    with pytest.raises(OutOfService) as refused:
        planner.plan(Policy.CASCADE, 1000.0, 0.0, OnInfeasible.REJECT)
    assert refused.value.message == "no cascade plan is in service: its engines failed"
    assert planner.plan(Policy.AUTO, 1000.0, 0.0, OnInfeasible.REJECT).name == "fast"


def test_the_cascade_policy_starts_a_cascade_whose_first_stage_fits_exactly() -> None:
    planner, stage = _planner(), STAGE_MS * 1.1
    assert planner.plan(Policy.CASCADE, stage + 1.0, 0.0, OnInfeasible.REJECT).name == "cascade"
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.CASCADE, stage + 1.0 - 0.01, 0.0, OnInfeasible.REJECT)


def test_continue_cascade_gates_stages_on_entropy_and_members_on_top_probability() -> None:
    planner, stage = _planner(), STAGE_MS * 1.1
    stages = Plan(Policy.CASCADE, "cascade", ["s1", "s2", "s3"], [0.1, 0.9], kind=PlanKind.STAGES)
    go = planner.continue_cascade
    assert not go(stages, 1, 0.1, 1000.0, 0.0)  # entropy at the threshold: sure, stop
    assert go(stages, 1, 0.5, 1000.0, 0.0)  # unsure, and the next stage fits
    assert not go(stages, 2, 0.5, 1000.0, 0.0)  # step 2's own threshold (0.9): sure
    assert not go(stages, 3, 5.0, 1000.0, 0.0)  # nothing left to run
    assert go(stages, 1, 0.5, 0.5 + stage + 1.0, 0.5)  # the next stage fits exactly (queue + p99 + margin)
    assert not go(stages, 1, 0.5, 0.5 + stage + 1.0 - 0.01, 0.5)
    late = Plan(Policy.CASCADE, "cascade", ["s1", "s2", "s3"], [0.1, 0.9], feasible=False, kind=PlanKind.STAGES)
    assert go(late, 1, 0.5, 0.0, 0.0)  # best effort goes on whatever the time
    members = Plan(Policy.AUTO, "m", ["s1", "s2"], [0.9], kind=PlanKind.MEMBERS)
    assert not go(members, 1, 0.9, 1000.0, 0.0)  # top probability at the threshold: sure, stop
    assert go(members, 1, 0.5, 1000.0, 0.0)


def test_infeasible_plan_rejected_or_best_effort() -> None:
    ladder = _ladder()
    planner = Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0)
    from service.errors import DeadlineInfeasible

    with pytest.raises(DeadlineInfeasible) as e:
        planner.plan(Policy.STATIC, 0.5, 0.0, OnInfeasible.REJECT)
    assert e.value.extra["fastest_ms"] == pytest.approx(2.1)
    plan = planner.plan(Policy.STATIC, 0.5, 0.0, OnInfeasible.BEST_EFFORT)
    assert plan.feasible is False and plan.name == "fast"
    for profile in ladder.rungs[0].profiles:  # fast's p99 with more digits than the answer gives: to the microsecond
        profile.p99_ms = 1.0123456
    planner = Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0)
    with pytest.raises(DeadlineInfeasible) as e:
        planner.plan(Policy.STATIC, 0.5, 0.0, OnInfeasible.REJECT)
    assert e.value.extra["fastest_ms"] == 2.012
    assert isinstance(plan, Plan)


def test_predictor_moves_from_prior_to_observed() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs], window=50)
    assert predictor.predict("s1", 1) == pytest.approx(22.0)
    assert predictor.predict("s1", 4) == pytest.approx(22.0)  # interpolated between equal profiles
    assert predictor.profiled_p50("s1", 1) == pytest.approx(STAGE_MS)  # the profile's p50
    for _ in range(20):
        predictor.observe("s1", 1, 5.0)
    assert predictor.profiled_p50("s1", 1) == pytest.approx(STAGE_MS)  # what the engine costs: unchanged
    assert predictor.predict("s1", 1) == pytest.approx(5.0 * 1.1)  # the p90, with the profile's p99/p90
    for _ in range(2):  # a rare stall moves neither
        predictor.observe("s1", 1, 80.0)
    for _ in range(8):
        predictor.observe("s1", 1, 5.0)
    assert predictor.predict("s1", 1) == pytest.approx(5.0 * 1.1)
    assert predictor.predict("s1", 4) == pytest.approx(22.0)  # other batch sizes keep their prior


def test_predictor_forgets_old_observations(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.predictor as predictor_module

    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs], window=50)
    for _ in range(20):
        predictor.observe("s1", 1, 50.0)  # a burst made it slow
    assert predictor.predict("s1", 1) == pytest.approx(50.0 * 1.1)
    now = time.monotonic()
    monkeypatch.setattr(predictor_module.time, "monotonic", lambda: now + predictor_module.HORIZON_S + 1)
    assert predictor.predict("s1", 1) == pytest.approx(22.0)  # back to the profile once the burst is old


def _slow_quick_rung(monkeypatch: pytest.MonkeyPatch, gap_s: float) -> tuple[LatencyPredictor, Planner, list[float]]:
    """A planner whose quick rung has just run 20 times, `gap_s` apart, at 5 ms (its profile's p99: 1.1 ms), on a
    clock the test moves (the list's one item, in seconds)."""
    import service.predictor as predictor_module

    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs], window=50)
    planner = Planner(ladder, predictor, margin_ms=1.0)
    clock = [time.monotonic()]
    monkeypatch.setattr(predictor_module.time, "monotonic", lambda: clock[0])
    for _ in range(20):
        clock[0] += gap_s
        predictor.observe("fast", 1, 5.0)
    return predictor, planner, clock


def test_a_refusal_on_estimates_no_run_has_refreshed_drops_them_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only admitted requests are observed: estimates that refuse every request must not outlive the runs."""
    import service.predictor as predictor_module

    predictor, planner, clock = _slow_quick_rung(monkeypatch, 0.01)
    prior = predictor.prior("fast", 1)
    assert predictor.predict("fast", 1) == pytest.approx(5.0 * 1.1)  # its p90 times the profile's p99/p90
    assert predictor.predict("s1", 1) > 2 * predictor.prior("s1", 1)  # not run lately: the pooled slowdown
    assert not predictor.forget_if_starved()  # engines ran just now
    clock[0] += predictor_module.IDLE_S * 0.9
    with pytest.raises(DeadlineInfeasible):  # a short pause: the estimates stand
        planner.plan(Policy.STATIC, 2.5, 0.0, OnInfeasible.REJECT)
    clock[0] += predictor_module.IDLE_S * 0.2
    planner.in_flight = lambda: 1  # a job in flight: an engine may be mid-run, however long since the last ended
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.STATIC, 2.5, 0.0, OnInfeasible.REJECT)
    planner.in_flight = lambda: 0
    assert predictor.predict("fast", 1) == pytest.approx(5.0 * 1.1)  # a quiet spell alone drops nothing ...
    assert planner.plan(Policy.STATIC, 2.5, 0.0, OnInfeasible.REJECT).name == "fast"  # ... a refusal does
    assert predictor.predict("fast", 1) == pytest.approx(prior)
    assert predictor.predict("s1", 1) == pytest.approx(predictor.prior("s1", 1))
    assert not predictor.forget_if_starved()  # nothing left to drop
    with pytest.raises(DeadlineInfeasible):  # on the profiles, what does not fit is still refused
        planner.plan(Policy.STATIC, 1.5, 0.0, OnInfeasible.REJECT)
    for _ in range(20):  # runs again: the slow runs before the pause are not pooled with these
        clock[0] += 0.01
        predictor.observe("fast", 1, 0.5)
    assert predictor.predict("fast", 1) == pytest.approx(0.5 * 1.1)


def test_a_trickle_of_runs_does_not_keep_estimates_that_refuse_almost_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in a sweep at 1 ms: slow runs set the estimates, the server refused 95-100 % of the requests, and the few it
    admitted ran on cooling cores, slow again. Once refusals outnumber runs STARVED to one, the estimates go."""
    import service.predictor as predictor_module

    predictor, planner, clock = _slow_quick_rung(monkeypatch, 0.0001)  # a burst of slow runs, within 2 ms
    step = predictor_module.IDLE_S / 100  # then 100 requests per IDLE_S, one run per 50 of them, as slow
    refused = 0
    for i in range(1, 1000):
        clock[0] += step
        if i % 50 == 0:
            predictor.observe("fast", 1, 5.0)
        try:
            planner.plan(Policy.STATIC, 2.5, 0.0, OnInfeasible.REJECT)
        except DeadlineInfeasible:
            refused += 1
            continue
        break
    # While the burst is within the last IDLE_S, the runs outnumber the refusals' share; as soon as it is not, 2 runs
    # (the trickle) face 100 refusals, and the next request is planned on the profiles. Runs never paused for IDLE_S.
    assert 95 <= refused <= 100
    assert predictor.predict("fast", 1) == pytest.approx(predictor.prior("fast", 1))


def test_refusals_under_load_keep_the_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests refused while the engines keep running (a tight deadline, a busy machine) are not starvation."""
    predictor, planner, clock = _slow_quick_rung(monkeypatch, 0.01)
    for i in range(1000):  # one run for every 10 refusals, for 5 s
        clock[0] += 0.005
        if i % 10 == 0:
            predictor.observe("fast", 1, 5.0)
        with pytest.raises(DeadlineInfeasible):
            planner.plan(Policy.STATIC, 2.5, 0.0, OnInfeasible.REJECT)
    assert predictor.predict("fast", 1) == pytest.approx(5.0 * 1.1)


# -- the auto planner and member cascades -------------------------------------------------------------------
def _auto_ladder() -> Ladder:
    ladder = _ladder()
    ladder.rungs.append(_record(Rung, "slow", STAGE_MS, kind="exit", exit=3, val_accuracy=0.90, test_accuracy=0.9))
    ladder.cascades[0].val_accuracy_by_depth = [0.85, 0.92, 0.95]
    ladder.rungs += [  # dominated (the member cascade serves them), so only the cascade is an auto option
        _record(Rung, name, 1.0, kind="member", exit=1, val_accuracy=0.82, test_accuracy=0.82, dominated=True)
        for name in ("m1", "m2")
    ]
    ladder.member_cascades = [
        MemberCascade.model_construct(
            name="members",
            members=["m1", "m2"],
            thresholds=[0.5],
            val_accuracy_by_depth=[0.82, 0.88],
            test_exit_share=[0.6, 0.4],
            dominated=False,
        )
    ]
    return ladder


def test_auto_takes_the_most_accurate_answer_within_the_time_left() -> None:
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    # p99s: fast, m1, m2 1.1 ms; slow and each stage 22 ms. Budget = time left - margin.
    assert planner.plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT).name == "members"  # m1 fits: 0.82 > fast 0.80
    assert planner.plan(Policy.AUTO, 3.5, 0.0, OnInfeasible.REJECT).name == "members"  # both members: 0.88
    assert planner.plan(Policy.AUTO, 25.0, 0.0, OnInfeasible.REJECT).name == "slow"  # 0.90 > cascade at 1 stage
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "cascade"  # two stages: 0.92
    assert planner.plan(Policy.AUTO, 50.0, 30.0, OnInfeasible.REJECT).name == "members"  # a queue shrinks the budget
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.AUTO, 1.5, 0.0, OnInfeasible.REJECT)
    assert not planner.plan(Policy.AUTO, 1.5, 0.0, OnInfeasible.BEST_EFFORT).feasible


def test_auto_takes_the_cheapest_option_within_tie_se_standard_errors_of_the_best() -> None:
    """The one-standard-error rule over the val accuracies (costs as in the load test below: members 1.4 ms,
    slow 20, the stage cascade 20 a stage). On 100 val images one standard error of 0.92 is 2.7 pp, of 0.90 3 pp."""
    ladder = _auto_ladder()
    ladder.split_sizes = {"val": 100, "test": 100}
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])

    def auto(tie_se: float, time_left_ms: float) -> str:
        return (
            Planner(ladder, predictor, margin_ms=1.0, tie_se=tie_se)
            .plan(Policy.AUTO, time_left_ms, 0.0, OnInfeasible.REJECT)
            .name
        )

    assert auto(0.0, 50.0) == "cascade"  # no ties: the most accurate, two stages (0.92)
    assert auto(1.0, 50.0) == "slow"  # 0.90 is within 2.7 pp of 0.92 and costs 20 ms, not 40
    assert auto(3.0, 50.0) == "members"  # 0.88 is within 8.1 pp and costs 1.4 ms
    assert auto(0.0, 25.0) == "slow"
    assert auto(1.0, 25.0) == "members"  # best 0.90: 0.88 is within 3 pp
    assert auto(1.0, 2.2) == "members"  # as without ties: only one step fits, and m1 (0.82) beats fast (0.80)
    ladder.split_sizes = {}  # a ladder that does not say how many val images: no ties
    assert auto(1.0, 50.0) == "cascade"


def _packed(first: int, last: int, n: int = 100) -> str:
    """Right on val images first..last-1 of n, packed as ladder.json records it."""
    right = np.zeros(n, bool)
    right[first:last] = True
    return pack_right(right)


def test_auto_ties_by_the_paired_standard_error_where_the_ladder_records_each_val_image() -> None:
    """As above, on 100 val images, but the ladder records which images each option answers right. The stage
    cascade at two stages (0.92) is right wherever slow (0.90) is, and on 2 more: a consistent gain, paired standard
    error 1.4 pp, so slow no longer ties with it (the binomial rule above took slow). The member cascade (0.88, 1.4
    ms) ties only where its answers are noisy against the cascade's (right on images 12-99: paired standard error
    4.5 pp), not where it is the cascade minus 4 images (2.0 pp)."""
    ladder = _auto_ladder()
    ladder.split_sizes = {"val": 100, "test": 100}
    ladder.rung("slow").val_right_by_depth = [_packed(0, 90)]
    ladder.cascades[0].val_right_by_depth = [_packed(0, 85), _packed(0, 92), _packed(0, 95)]
    members = ladder.member_cascades[0]
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])

    def auto(tie_se: float) -> str:
        planner = Planner(ladder, predictor, margin_ms=1.0, tie_se=tie_se)
        return planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name

    members.val_right_by_depth = [_packed(0, 82), _packed(0, 88)]  # consistent: the cascade's minus 4
    assert auto(1.0) == "cascade"
    assert auto(3.0) == "members"  # 3 x 2.0 pp >= 4 pp
    members.val_right_by_depth = [_packed(18, 100), _packed(12, 100)]  # noisy against the cascade
    assert auto(1.0) == "members"
    assert auto(0.0) == "cascade"


def test_arrival_rate_follows_steady_arrivals_and_decays_when_they_stop() -> None:
    rate = ArrivalRate(tau_s=0.5)
    for i in range(600):  # 200 a second for 3 s
        rate.arrive(now=100.0 + i / 200)
    assert rate.per_second(now=103.0) == pytest.approx(200, rel=0.05)
    assert rate.per_second(now=105.0) == pytest.approx(rate.per_second(now=103.0) * math.exp(-2 / 0.5))
    assert Budget(0.5, rate).ms(now=103.0) == pytest.approx(0.5 / rate.per_second(now=103.0) * 1e3)
    assert Budget(0.5).ms() == math.inf  # nothing arrived yet: no limit


def _arrivals(budget: Budget, per_s: float) -> None:
    """`per_s` arrivals within microseconds (the decay is negligible): the budget's rate reads `per_s` a second."""
    budget.rate._rate, budget.rate._at = 0.0, time.monotonic()
    for _ in range(round(per_s)):
        budget.rate.arrive()


def test_auto_under_load_keeps_to_what_the_arrival_rate_leaves_a_request() -> None:
    """Average costs (p50 1.0 ms each, see _record): fast 1.0; members m1 + 0.4 x m2 (60 % stop after m1) =
    1.4; slow 20; the stage cascade 60 (its val shares say every image runs all three stages)."""
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    budget = Budget(utilization=0.7, rate=ArrivalRate(tau_s=1.0))
    planner = Planner(ladder, predictor, margin_ms=1.0, budget=budget)
    assert planner.cost(planner.options["members"]) == pytest.approx(1.4)
    assert planner.cost(planner.options["cascade"]) == pytest.approx(60.0)

    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "cascade"  # idle: as before
    _arrivals(budget, 10)  # 70 ms a request
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "cascade"
    _arrivals(budget, 100)  # 7 ms: the cascade (60) and slow (20) cost too much; the member cascade (1.4) does not
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "members"
    _arrivals(budget, 600)  # 1.17 ms: only fast
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "fast"
    _arrivals(budget, 2000)  # 0.35 ms: nothing is within it; the cheapest option that fits answers
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "fast"
    # The deadline still rules: with 2.2 ms left only the one-step options fit (as without a budget).
    _arrivals(budget, 100)
    assert planner.plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT).name == "members"
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.AUTO, 1.5, 0.0, OnInfeasible.REJECT)


def test_auto_s_costs_are_the_profiles_so_the_option_it_runs_is_not_priced_above_those_it_does_not() -> None:
    """At 600 req/s (1.17 ms a request) only fast (profile 1.0 ms) is within the budget. Its own runs under load
    estimate it at 3 ms (p90) while m1 and m2, not run, keep their profiles: priced on those estimates it cost more
    than the member cascade (1.4) and the member cascade answered, until its own runs made it the dearer one.
    On the profiles fast stays the option within the budget; the estimate still rules whether it fits the deadline."""
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    predictor._p90[("fast", 1)] = (time.monotonic(), 3.0)
    budget = Budget(utilization=0.7, rate=ArrivalRate(tau_s=1.0))
    planner = Planner(ladder, predictor, margin_ms=1.0, budget=budget)
    _arrivals(budget, 600)
    assert planner.cost(planner.options["fast"]) == pytest.approx(1.0)
    assert planner.cost(planner.options["members"]) == pytest.approx(1.4)
    assert predictor.predict("fast") > 3.0
    assert planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "fast"
    assert planner.plan(Policy.AUTO, 3.5, 0.0, OnInfeasible.REJECT).name == "members"  # fast's 3+ ms do not fit


def test_auto_s_load_budget_shrinks_after_late_answers_and_queue_refusals_and_widens_with_on_time_ones() -> None:
    """The budget's restraint (service/load.py): at 100 req/s the budget (7 ms) lets the member cascade (1.4) answer;
    auto's late answers divide it (step 1.0: x2 each) until only fast (1.0) is within it, and on-time answers widen
    it again. A request refused because of the queue ahead counts as a late answer; one refused because its deadline
    alone is too short does not, nor do other policies' answers."""
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    restraint = Caution(step=1.0)
    budget = Budget(utilization=0.7, rate=ArrivalRate(tau_s=1.0), restraint=restraint)
    planner = Planner(ladder, predictor, margin_ms=1.0, budget=budget)
    _arrivals(budget, 100)  # 7 ms a request

    def auto() -> str:
        return planner.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name

    assert auto() == "members"
    late = Plan(Policy.AUTO, "members", ["m1", "m2"], [0.5], kind=PlanKind.MEMBERS)
    planner.observe(Plan(Policy.FIXED, "slow", ["slow"]), -5.0)  # not auto's: no restraint
    assert restraint.factor == 1.0
    planner.observe(late, -0.2)
    planner.observe(late, -math.inf)  # expired in the queue
    assert restraint.factor == pytest.approx(4.0) and auto() == "members"  # 1.75 ms a request: 1.4 is within it
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.AUTO, 1.5, 0.0, OnInfeasible.REJECT)  # fast's 1.1 ms + margin 1.0: the deadline's fault
    assert restraint.factor == pytest.approx(4.0)
    with pytest.raises(DeadlineInfeasible):
        planner.plan(Policy.AUTO, 2.5, 5.0, OnInfeasible.REJECT)  # 2.1 ms would fit without the 5 ms queue
    assert restraint.factor == pytest.approx(8.0) and auto() == "fast"  # 0.875 ms: the cheapest answers
    for _ in range(100):  # each on-time answer divides the factor by 2 ** (1 / 99)
        planner.observe(late, 5.0)
    assert restraint.factor == pytest.approx(8.0 / 2 ** (100 / 99)) and auto() == "members"


def test_an_option_s_cost_counts_every_step_without_recorded_shares_and_a_cost_at_the_cap_is_within_it() -> None:
    """A stage cascade whose shares were not recorded (or do not match its steps) is costed as if every image ran
    every stage; an option that costs exactly what the load leaves a request is not over it."""
    ladder = _auto_ladder()
    unrecorded = ladder.cascades[0].model_copy(update={"name": "unrecorded", "expected_exit_share": []})
    ladder.cascades = [*ladder.cascades, unrecorded]
    planner = Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0)
    assert planner.options["unrecorded"].reach == [1.0, 1.0, 1.0]
    assert planner.cost(planner.options["unrecorded"]) == pytest.approx(60.0)
    options = [planner.options[name] for name in ("fast", "members")]
    cap = planner.cost(planner.options["members"])  # 1.4; fast costs 1.0 and is less accurate
    assert planner._best_within(options, 50.0, cost_cap_ms=cap).name == "members"
    assert planner._best_within(options, 50.0, cost_cap_ms=cap - 1e-9).name == "fast"


def _member_scheduler() -> tuple[Scheduler, Planner, dict[str, SleepEngine]]:
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {"m1": SleepEngine(1.0, unsure=True), "m2": SleepEngine(1.0, unsure=False), "fast": SleepEngine(1.0)}
    calls: list[int] = []

    def combine(member_logits: list[np.ndarray]) -> np.ndarray:  # a stand-in stacker: softmax of the sum
        calls.append(len(member_logits[0]))
        z = sum(member_logits)
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    scheduler = Scheduler(engines, planner, predictor, 8, 4, margin_ms=1.0, combiners={"members": [combine]})
    scheduler.calls = calls  # type: ignore[attr-defined]
    return scheduler, planner, engines


def test_a_member_cascade_goes_on_while_unsure_and_combines_what_ran() -> None:
    scheduler, planner, engines = _member_scheduler()
    scheduler.start()
    try:
        done: list[Job] = []
        event = threading.Event()
        now = time.monotonic()
        plan = planner.plan(Policy.FIXED, 500, 0.0, OnInfeasible.REJECT, "members")
        job = Job("j", now, now + 0.5, np.zeros((1, 4), np.float32), plan, lambda j: (done.append(j), event.set()))
        scheduler.submit(job)
        assert event.wait(2)
        # m1 answered uniformly (top probability 0.1 < 0.5): m2 ran, and the stacker combined both.
        assert job.error is None and job.step == 2 and len(job.member_logits) == 2
        assert scheduler.calls == [1]  # type: ignore[attr-defined]
        assert float(np.exp(job.logits).max()) > 0.99  # the combination is m2's confident answer
        assert engines["m1"].batches == [1] and engines["m2"].batches == [1]
    finally:
        scheduler.stop()


def test_a_member_cascade_stops_after_a_confident_first_member() -> None:
    scheduler, planner, engines = _member_scheduler()
    engines["m1"].unsure = False
    scheduler.start()
    try:
        done: list[Job] = []
        event = threading.Event()
        now = time.monotonic()
        plan = planner.plan(Policy.FIXED, 500, 0.0, OnInfeasible.REJECT, "members")
        job = Job("j", now, now + 0.5, np.zeros((1, 4), np.float32), plan, lambda j: (done.append(j), event.set()))
        scheduler.submit(job)
        assert event.wait(2)
        assert job.step == 1 and engines["m2"].batches == [] and scheduler.calls == []  # type: ignore[attr-defined]
    finally:
        scheduler.stop()


class FailingEngine(SleepEngine):
    def run(self, x: np.ndarray) -> list[np.ndarray]:
        raise RuntimeError("injected engine fault")


class CountingMetrics:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.engine_failures = self

    def labels(self, engine: str) -> CountingMetrics:
        self.failures.append(engine)
        return self

    def inc(self) -> None:
        pass

    def observe_batch(self, engine: str, size: int, error_ms: float) -> None:
        pass


def test_a_failing_engine_leaves_service_and_its_requests_are_replanned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {"slow": FailingEngine(1.0), "fast": SleepEngine(1.0, unsure=False), "m1": SleepEngine(1.0)}
    metrics = CountingMetrics()
    scheduler = Scheduler(engines, planner, predictor, 8, 4, margin_ms=1.0, metrics=metrics)
    scheduler.start()
    try:
        done: list[Job] = []
        event = threading.Event()
        now = time.monotonic()
        plan = planner.plan(Policy.STATIC, 500, 0.0, OnInfeasible.REJECT)
        assert plan.name == "slow"  # the most accurate rung: it will fail
        job = Job("j", now, now + 0.5, np.zeros((1, 4), np.float32), plan, lambda j: (done.append(j), event.set()))
        with caplog.at_level("ERROR", logger="anytime.scheduler"):
            scheduler.submit(job)
            assert event.wait(2)
        assert job.error is None and job.plan.name == "fast" and job.step == 1  # answered by the next best
        assert metrics.failures == ["slow"] and "injected engine fault" in caplog.text
        assert planner.plan(Policy.STATIC, 500, 0.0, OnInfeasible.REJECT).name == "fast"  # out of service now
        with pytest.raises(OutOfService):
            planner.plan(Policy.FIXED, 500, 0.0, OnInfeasible.REJECT, "slow")
    finally:
        scheduler.stop()


def test_a_crashed_worker_logs_why_answers_what_was_queued_and_takes_no_more(no_worker, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    scheduler, planner, _ = no_worker
    done: list[Job] = []
    jobs = [_job(planner, Policy.CASCADE, 5000, done) for _ in range(3)]

    def broken() -> list[Job]:
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(scheduler, "_take_batch", broken)
    for job in jobs:
        scheduler.submit(job)
    with caplog.at_level("ERROR"):
        scheduler.start()
        deadline = time.monotonic() + 2
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(done) == 3 and all(isinstance(j.error, InternalError) for j in jobs)  # not silence
    assert [j.error.message for j in jobs if j.error] == ["internal error: the server cannot run models now"] * 3
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("anytime.scheduler", "the scheduler's worker stopped")
    ]
    assert not scheduler.alive
    with pytest.raises(InternalError):
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))


def test_predictor_scales_unobserved_engines_by_the_machines_slowdown() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs], window=50)
    before = predictor.predict("s2", 1)
    for _ in range(20):
        predictor.observe("s1", 1, 40.0)  # s1 runs at twice its profiled p90 (20 ms)
    assert predictor.predict("s2", 1) == pytest.approx(2.0 * before)  # s2 never ran: scaled alike
    for _ in range(20):
        predictor.observe("s1", 1, 1.0)  # a fast machine never scales the idle profile down
    assert predictor.predict("s2", 1) >= before
