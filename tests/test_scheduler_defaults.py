"""What the scheduler does when not told otherwise: nothing runs inline, a job is not best effort, and its
faults are logged under its own logger (tests/test_scheduler.py has the fakes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from service.errors import DeadlineExpired
from service.planner import OnInfeasible, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Job, Scheduler
from tests.test_scheduler import FailingEngine, SleepEngine, _auto_ladder, _job, _ladder, _setup


def test_without_an_inline_limit_even_a_quick_job_goes_to_the_worker() -> None:
    ladder = _ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    scheduler = Scheduler({"fast": SleepEngine(1.0, unsure=False)}, planner, predictor, 8, 4, margin_ms=1.0)
    scheduler.start()
    try:
        event = threading.Event()
        job = _job(planner, Policy.STATIC, 500, [], event)
        assert job.plan.engines == ["fast"]  # 1 ms: quick for any inline limit of 1 ms or more
        seen: list[str] = []
        job.on_done = lambda j: (seen.append(threading.current_thread().name), event.set())  # type: ignore[func-returns-value]
        scheduler.submit(job, inline=True)
        assert event.wait(2) and seen == ["anytime-worker"]
    finally:
        scheduler.stop()


def test_a_job_is_not_best_effort_unless_made_so() -> None:
    """A job made without `best_effort` whose time ran out in the queue gets 504, not a late run."""
    scheduler, planner, _ = _setup()  # its worker never starts: the test takes the batch itself
    now = time.monotonic()
    plan = planner.plan(Policy.STATIC, 5000, 0.0, OnInfeasible.REJECT)
    done: list[Job] = []
    job = Job("j", now, now + 0.0015, np.zeros((1, 4), np.float32), plan, done.append)
    scheduler.submit(job)
    with scheduler._cond:
        assert scheduler._take_batch() == []
    assert done == [job] and isinstance(job.error, DeadlineExpired) and job.logits is None


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
        assert [(r.name, r.levelname) for r in caplog.records] == [("anytime.scheduler", "ERROR")]
        assert "engine slow failed" in caplog.records[0].getMessage()
    finally:
        scheduler.stop()
