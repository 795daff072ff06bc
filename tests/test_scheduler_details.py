"""Scheduler details tests/test_scheduler.py leaves open (written against mutants that survived it, see
docs/mutation.md): defaults, the worker thread, refusals' messages, the wait estimate, which queued jobs share a
run, re-planning after a fault, what one run records per job, and what a cascade's gate is given."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.manifest import MemberCascade, Rung
from service.errors import DeadlineExpired, DeadlineInfeasible, InternalError, OutOfService, QueueFull, ShuttingDown
from service.planner import OnInfeasible, Plan, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Job, Scheduler
from tests.test_scheduler import (
    STAGE_MS,
    CountingMetrics,
    FailingEngine,
    SleepEngine,
    _auto_ladder,
    _job,
    _ladder,
    _member_scheduler,
    _occupy_worker,
    _record,
    _setup,
)

ROOT = Path(__file__).resolve().parents[1]
X = np.zeros((1, 4), np.float32)


def _wait_for(jobs: list[Job], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(j.finished is None for j in jobs) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert all(j.finished is not None for j in jobs)


def _on(engine: str, deadline: float, done: list[Job], best_effort: bool = False) -> Job:
    """A job planned on one engine, due at `deadline` (monotonic seconds)."""
    now = time.monotonic()
    return Job(str(len(done)), now, deadline, X, Plan(Policy.STATIC, engine, [engine]), done.append, best_effort)


# -- defaults and the worker thread ----------------------------------------------------------------------------


def test_without_an_inline_limit_even_a_quick_job_goes_to_the_worker_and_the_limit_is_inclusive() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    assert predictor.profiled_p50("fast") == 1.0
    for limit, thread in ((None, "anytime-worker"), (1.0, threading.current_thread().name)):
        inline = {} if limit is None else {"inline_max_ms": limit}
        scheduler = Scheduler({"fast": SleepEngine(1.0, unsure=False)}, planner, predictor, 8, 4, 1.0, **inline)
        scheduler.start()
        try:
            event = threading.Event()
            job = _job(planner, Policy.STATIC, 500, [], event)
            assert job.plan.engines == ["fast"]
            seen: list[str] = []
            job.on_done = lambda j, seen=seen, event=event: (seen.append(threading.current_thread().name), event.set())  # type: ignore[misc]
            scheduler.submit(job, inline=True)
            assert event.wait(2) and seen == [thread], limit
        finally:
            scheduler.stop()


def test_a_job_is_not_best_effort_unless_made_so() -> None:
    """A job made without `best_effort` whose time ran out in the queue gets 504, not a late run."""
    scheduler, planner, _ = _setup()  # its worker never starts: the test takes the batch itself
    now = time.monotonic()
    plan = planner.plan(Policy.STATIC, 5000, 0.0, OnInfeasible.REJECT)
    done: list[Job] = []
    job = Job("j", now, now - 0.001, X, plan, done.append)
    scheduler.submit(job)
    with scheduler._cond:
        assert scheduler._take_batch() == []
    assert done == [job] and isinstance(job.error, DeadlineExpired) and job.logits is None
    assert job.error.message == "0.00 ms were left after queueing: no rung fits"


def test_a_worker_left_running_does_not_keep_the_process_alive() -> None:
    """A server that exits without stop() (a crash, a kill of its lifespan) must not hang on the worker thread."""
    code = "from tests.test_scheduler import _setup\ns, _, _ = _setup()\ns.start()\nassert s.alive"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=20, check=True)


# -- refusals, faults and what they say ------------------------------------------------------------------------


def test_refusals_say_why_and_when_to_retry() -> None:
    scheduler, planner, _ = _setup()  # no worker: whatever is submitted stays queued
    done: list[Job] = []
    queued = [_job(planner, Policy.CASCADE, 5000, done) for _ in range(8)]
    for job in queued:
        scheduler.submit(job)
    with pytest.raises(QueueFull) as full:
        scheduler.submit(_job(planner, Policy.CASCADE, 5000, done))
    assert (full.value.message, full.value.headers) == (
        "8 requests in the queue (limit 8); retry shortly",
        {"Retry-After": "1"},
    )
    scheduler.drain()
    with pytest.raises(ShuttingDown) as draining:
        scheduler.check_room()
    assert (draining.value.message, draining.value.headers) == ("the server is shutting down", {"Retry-After": "1"})
    scheduler.stop()
    assert done == queued
    assert {(j.error.message, tuple(j.error.headers.items())) for j in queued if j.error} == {
        ("the server is shutting down", (("Retry-After", "1"),))
    }
    scheduler.crashed = True
    with pytest.raises(InternalError, match=r"^internal error: the server cannot run models now$"):
        scheduler.check_room()


def test_an_engine_fault_is_logged_under_the_scheduler_s_name(caplog: pytest.LogCaptureFixture) -> None:
    """The logger's name is in every log line (service/logs.py): `anytime.scheduler`."""
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {"slow": FailingEngine(1.0), "fast": SleepEngine(1.0, unsure=False)}
    scheduler = Scheduler(engines, planner, predictor, 8, 4, margin_ms=1.0)
    scheduler.start()
    try:
        event = threading.Event()
        job = _job(planner, Policy.STATIC, 500, [], event)
        assert job.plan.name == "slow"
        with caplog.at_level("ERROR"):
            scheduler.submit(job)
            assert event.wait(2)
        assert [(r.name, r.getMessage()) for r in caplog.records] == [
            ("anytime.scheduler", "engine slow failed: taken out of service")
        ]
    finally:
        scheduler.stop()


def test_a_failing_completion_callback_is_logged_and_the_worker_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    scheduler, planner, _ = _setup()
    scheduler.start()
    try:
        done: list[Job] = []

        def broken(job: Job) -> None:
            raise RuntimeError("injected callback fault")

        first = _job(planner, Policy.STATIC, 5000, done)
        first.plan, first.on_done = Plan(Policy.STATIC, "s1", ["s1"]), broken
        second = _job(planner, Policy.STATIC, 5000, done)
        second.plan = Plan(Policy.STATIC, "s1", ["s1"])
        with caplog.at_level("ERROR"):
            scheduler.submit(first)
            scheduler.submit(second)
            _wait_for([first, second])
        assert done == [second] and scheduler.depth() == 0
        assert [(r.name, r.getMessage()) for r in caplog.records] == [
            ("anytime.scheduler", "completion callback of 0 failed")
        ]
    finally:
        scheduler.stop()


# -- the wait estimate and who shares a run ---------------------------------------------------------------------


def test_the_wait_estimate_counts_the_running_batch_and_earlier_due_work_in_batches() -> None:
    scheduler, _, _ = _setup()  # no worker: the test decides what runs
    predictor = scheduler.predictor
    now = time.monotonic()
    scheduler._busy_until = now + 0.010  # a batch predicted to end in 10 ms
    assert 5.0 < scheduler.wait_ms(now + 1.0) <= 10.0
    scheduler._busy_until = 0.0
    done: list[Job] = []
    jobs = [_on("s1", now + 1.0 + i * 1e-3, done) for i in range(6)]
    for job in jobs:
        scheduler.submit(job)
    assert scheduler.wait_ms(jobs[0].deadline - 1e-6) == 0.0  # nothing due before it
    assert scheduler.wait_ms(jobs[0].deadline) == predictor.predict("s1", 1)  # due at the same time: ahead
    assert scheduler.wait_ms(jobs[5].deadline) == predictor.predict("s1", 4) * 2  # 6 items, batches of up to 4
    scheduler.batch_caps = {"s1": 2}
    assert scheduler.wait_ms(jobs[5].deadline) == predictor.predict("s1", 2) * 3
    scheduler.batch_caps = {}
    with scheduler._cond:
        batch = scheduler._take_batch()  # 4 run now, predicted to end after predict("s1", 4)
    assert batch == jobs[:4]
    running = scheduler.wait_ms(now + 10.0) - predictor.predict("s1", 2)
    assert predictor.predict("s1", 4) - 5.0 < running <= predictor.predict("s1", 4)


def test_a_queued_job_joins_a_run_only_if_the_run_still_ends_by_its_deadline() -> None:
    """The boundary is inclusive; a job that no longer has a feasible plan (best effort) joins whatever its deadline."""
    scheduler, _, _ = _setup()
    predictor, now, far = scheduler.predictor, time.monotonic(), time.monotonic() + 10.0
    ends = now + (predictor.predict("s1", 2) + scheduler.margin_ms) / 1e3  # a run of two, and the margin
    for mate_deadline, feasible, joins in ((ends, True, True), (ends - 1e-7, True, False), (now - 1.0, False, True)):
        done: list[Job] = []
        head, mate = _on("s1", far, done), _on("s1", mate_deadline, done)
        mate.plan.feasible = feasible
        scheduler.submit(mate)
        batch = [head]
        with scheduler._cond:
            scheduler._add_mates(batch, "s1", now)
        assert (batch == [head, mate]) is joins, (mate_deadline - now, feasible)
        assert len(scheduler._heap) == (0 if joins else 1)
        scheduler._heap.clear()
        scheduler._jobs = 0


def test_a_job_whose_plan_no_longer_fits_moves_to_one_that_fits_with_no_queue_ahead() -> None:
    scheduler, _, _ = _setup()
    predictor, now = scheduler.predictor, time.monotonic()
    left = predictor.predict("fast") + scheduler.margin_ms + 0.5  # fast fits with no wait; with 1 ms more it would not
    job = _on("s1", now + left / 1e3, [])
    assert scheduler._fits_now(job, now) and job.plan.engines == ["fast"]


def test_a_job_keeps_its_plan_while_its_engine_and_the_margin_fit_inclusive_and_moves_when_they_do_not() -> None:
    """At dispatch a job stays on its plan when its next engine's predicted time plus the margin fits in the time
    left (the boundary included), and moves when the margin no longer fits. Dyadic times keep the boundary exact."""
    scheduler, _, _ = _setup()
    now, deadline = 0.0, 2.0**-5  # 31.25 ms left, exactly
    p = scheduler.predictor.predict("s1")
    for margin, stays in ((31.25 - p, True), (31.25 - p + 0.01, False)):
        scheduler.margin_ms = margin
        job = _on("s1", deadline, [])
        assert (p + margin == 31.25) is stays  # the boundary itself is exact
        assert scheduler._fits_now(job, now) and job.error is None
        assert (job.plan.engines == ["s1"]) is stays, (margin, job.plan.engines)
        if not stays:
            assert job.plan.engines == ["fast"]


# -- re-planning after an engine fault -------------------------------------------------------------------------


def test_replanning_after_a_fault_keeps_the_policy_the_rung_and_the_client_s_choice() -> None:
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    scheduler = Scheduler({}, planner, predictor, 8, 4, margin_ms=1.0)  # no worker, no engines: _replan alone
    planner.take_out("slow")
    done: list[Job] = []
    now = time.monotonic()
    fixed = Job("fixed", now, now + 0.5, X, Plan(Policy.FIXED, "slow", ["slow"]), done.append)
    scheduler._replan(fixed)  # the client named the rung that failed: no other answers for it
    assert done == [fixed] and isinstance(fixed.error, OutOfService)
    tight = Job("tight", now, now + 0.0015, X, Plan(Policy.STATIC, "slow", ["slow"]), done.append)
    scheduler._replan(tight)  # 1.5 ms left: fast needs 1.1 + the 1 ms margin
    assert done == [fixed, tight] and isinstance(tight.error, DeadlineInfeasible)
    late = Job("late", now, now + 0.0015, X, Plan(Policy.STATIC, "slow", ["slow"]), done.append, best_effort=True)
    scheduler._replan(late)  # best effort: runs on the fastest plan, late
    assert done == [fixed, tight] and late.error is None and late.plan.engines == ["fast"] and not late.plan.feasible
    assert [e[2] for e in scheduler._heap] == [late]


# -- what a run records ----------------------------------------------------------------------------------------


def test_a_cascade_s_run_time_adds_up_over_its_stages_and_each_run_is_observed() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {f"s{k}": SleepEngine(STAGE_MS) for k in (1, 2, 3)}
    metrics = CountingMetrics()
    errors: list[float] = []
    metrics.observe_batch = lambda engine, size, error_ms: errors.append(error_ms)  # type: ignore[method-assign]
    scheduler = Scheduler(engines, planner, predictor, 8, 4, margin_ms=1.0, metrics=metrics)
    scheduler.start()
    try:
        job = _job(planner, Policy.CASCADE, 5000, [])
        scheduler.submit(job)
        _wait_for([job])
        assert job.step == 3 and job.run_s >= 3 * STAGE_MS / 1e3
        # Observed minus predicted (22 ms, the profile's p99): a 20 ms sleep and some overhead.
        assert len(errors) == 3 and all(-5.0 < e < 50.0 for e in errors), errors
    finally:
        scheduler.stop()


def test_jobs_that_share_a_run_each_keep_their_own_row() -> None:
    scheduler, planner, engines = _setup()
    scheduler.start()
    try:
        engines["s1"].gate.clear()
        blocker = _occupy_worker(scheduler, planner, [])
        jobs = [_job(planner, Policy.CASCADE, 5000, []) for _ in range(3)]
        for job in jobs:
            scheduler.submit(job)
        engines["s1"].gate.set()
        _wait_for([blocker, *jobs])
        assert max(engines["s1"].batches) == 3
        assert all(j.logits is not None and j.logits.shape == (1, 10) and j.step == 3 for j in [blocker, *jobs])
        assert sum(engines["s2"].batches) == sum(engines["s3"].batches) == 4  # one row each, stage after stage
    finally:
        scheduler.stop()


def test_batched_member_cascades_keep_each_member_s_own_output() -> None:
    scheduler, planner, engines = _member_scheduler()
    scheduler.start()
    try:
        engines["m1"].gate.clear()
        jobs = []
        for _ in range(3):
            now = time.monotonic()
            plan = planner.plan(Policy.FIXED, 500, 0.0, OnInfeasible.REJECT, "members")
            jobs.append(Job("j", now, now + 0.5, X, plan, lambda j: None))
        scheduler.submit(jobs[0])
        while jobs[0].started is None:
            time.sleep(0.0005)
        for job in jobs[1:]:
            scheduler.submit(job)
        engines["m1"].gate.set()
        _wait_for(jobs)
        assert engines["m1"].batches == [1, 2]
        confident = np.eye(10, dtype=np.float32)[[0]] * 50  # m2's raw output; the answer is the combination
        for job in jobs:
            assert [m.shape for m in job.member_logits] == [(1, 10), (1, 10)]
            assert np.array_equal(job.member_logits[1], confident) and not np.array_equal(job.logits, confident)
    finally:
        scheduler.stop()


def _three_members() -> tuple[Scheduler, Planner, list[str]]:
    ladder = _auto_ladder()
    ladder.rungs.append(
        _record(Rung, "m3", 1.0, kind="member", exit=1, val_accuracy=0.82, test_accuracy=0.82, dominated=True)
    )
    ladder.member_cascades.append(
        MemberCascade.model_construct(
            name="three",
            members=["m1", "m2", "m3"],
            thresholds=[0.5, 0.5],
            val_accuracy_by_depth=[0.82, 0.85, 0.88],
            test_exit_share=[0.4, 0.3, 0.3],
            dominated=True,
        )
    )
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    engines = {name: SleepEngine(1.0) for name in ("m1", "m2", "m3")}  # all unsure: every member runs
    used: list[str] = []

    def combiner(name: str) -> Any:
        def combine(member_logits: list[np.ndarray]) -> np.ndarray:
            used.append(f"{name} of {len(member_logits)}")
            return np.full((len(member_logits[0]), 10), 0.1)

        return combine

    combiners = {"three": [combiner("first two"), combiner("all three")]}
    return Scheduler(engines, planner, predictor, 8, 4, margin_ms=1.0, combiners=combiners), planner, used


def test_each_prefix_of_a_member_cascade_has_its_own_combiner_and_the_gate_sees_the_top_probability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler, planner, used = _three_members()
    gate = planner.continue_cascade
    seen: list[tuple[float, float]] = []

    def spy(plan: Plan, done: int, score: float, time_left_ms: float, wait_ms: float) -> bool:
        seen.append((score, time_left_ms))
        return gate(plan, done, score, time_left_ms, wait_ms)

    monkeypatch.setattr(planner, "continue_cascade", spy)
    scheduler.start()
    try:
        now = time.monotonic()
        plan = planner.plan(Policy.FIXED, 500, 0.0, OnInfeasible.REJECT, "three")
        job = Job("j", now, now + 0.5, X, plan, lambda j: None)
        scheduler.submit(job)
        _wait_for([job])
        assert job.step == 3 and used == ["first two of 2", "all three of 3"]
        # After each member: uniform answers, top probability 0.1; the time left, under 500 ms.
        assert [score for score, _ in seen] == pytest.approx([0.1, 0.1, 0.1])
        assert all(0 < left <= 500 for _, left in seen)
    finally:
        scheduler.stop()
