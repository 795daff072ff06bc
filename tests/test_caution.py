"""Auto's caution: late answers inflate its predictions, on-time ones deflate them; refusals never depend on it."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engines.manifest import Rung
from loadtest.harness import png_base64
from models.data import FashionMNIST
from service.app import create_app
from service.caution import Caution
from service.config import Settings
from service.errors import DeadlineExpired, DeadlineInfeasible
from service.load import ArrivalRate, Budget
from service.planner import OnInfeasible, Plan, PlanKind, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Job
from tests.test_scheduler import _arrivals, _auto_ladder, _job, _record, _setup


def test_caution_rises_on_late_answers_and_falls_back_to_one_on_time() -> None:
    caution = Caution(target=0.01, step=0.25, ceiling=4.0)
    assert caution.factor == 1.0
    caution.observe(late=True)
    assert caution.factor == pytest.approx(1.25)
    for _ in range(10):
        caution.observe(late=True)
    assert caution.factor == pytest.approx(4.0)  # the ceiling
    for _ in range(10_000):
        caution.observe(late=False)
    assert caution.factor == 1.0  # never below 1: caution only inflates


@pytest.mark.parametrize("late_share", [0.002, 0.05])
def test_caution_settles_where_the_target_share_of_answers_is_late(late_share: float) -> None:
    # Below the target share the factor drifts to 1; above it, to the ceiling. The balance point is the target.
    caution, rng = Caution(target=0.01, step=0.25, ceiling=16.0), random.Random(0)
    for _ in range(20_000):
        caution.observe(late=rng.random() < late_share)
    assert (caution.factor < 1.5) if late_share < 0.01 else (caution.factor > 8.0)


def test_caution_refuses_settings_that_cannot_work() -> None:
    for kwargs in ({"target": 0.0}, {"target": 1.0}, {"step": 0.0}, {"ceiling": 0.5}):
        with pytest.raises(ValueError, match="caution needs"):
            Caution(**kwargs)


def _cautious_planner(factor_log_steps: int) -> Planner:
    ladder = _auto_ladder()
    caution = Caution(step=1.0, ceiling=64.0)  # each late answer doubles the factor
    planner = Planner(ladder, LatencyPredictor([*ladder.stages, *ladder.rungs]), margin_ms=1.0, caution=caution)
    for _ in range(factor_log_steps):
        planner.observe(Plan(Policy.AUTO, "fast", ["fast"]), -1.0)
    return planner


def test_auto_under_caution_takes_a_cheaper_option_but_is_never_refused_for_it() -> None:
    # p99s: fast, m1, m2 1.1 ms; slow and each cascade stage 22 ms (tests/test_scheduler.py's ladder).
    assert _cautious_planner(0).plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "cascade"  # two stages
    doubled = _cautious_planner(1)  # factor 2: 2 x 44 ms no longer fits 49 ms; 2 x 22 does
    assert doubled.caution is not None and doubled.caution.factor == pytest.approx(2.0)
    assert doubled.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "slow"
    assert doubled.plan(Policy.AUTO, 50.0, 5.0, OnInfeasible.REJECT).name == "members"  # the wait is inflated too
    # Factor 64: nothing fits under caution, yet a plan that fits the bare prediction is still given, not refused.
    wary = _cautious_planner(6)
    plan = wary.plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT)
    assert plan.feasible and plan.engines[0] in {"fast", "m1"}
    with pytest.raises(DeadlineInfeasible):
        wary.plan(Policy.AUTO, 1.5, 0.0, OnInfeasible.REJECT)  # the same refusal as without caution


def test_where_caution_leaves_no_option_the_most_accurate_quick_first_step_answers() -> None:
    # A "quick" rung (p50 0.95 ms, p99 1.045, val 0.70) beside fast and m1 (p50 1.0 ms, p99 1.1; fast 0.80, the
    # member cascade 0.82 at its first step). Fast and m1 typically take no longer than quick at its p99: as quick.
    ladder = _auto_ladder()
    ladder.rungs.append(_record(Rung, "quick", 0.95, kind="exit", exit=1, val_accuracy=0.70, test_accuracy=0.7))
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])

    def wary(quick_fallback: bool) -> Planner:
        planner = Planner(
            ladder, predictor, 1.0, caution=Caution(step=1.0, ceiling=64.0), quick_fallback=quick_fallback
        )
        for _ in range(6):  # factor 64: nothing fits under caution
            planner.observe(Plan(Policy.AUTO, "quick", ["quick"]), -1.0)
        return planner

    assert wary(True).plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT).name == "members"
    assert wary(False).plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT).name == "quick"  # the quickest, as before
    # 1.07 ms after the margin: m1's bare p99 (1.1) does not fit, quick's (1.045) does: quick answers, not a refusal.
    assert wary(True).plan(Policy.AUTO, 2.07, 0.0, OnInfeasible.REJECT).name == "quick"
    with pytest.raises(DeadlineInfeasible):
        wary(True).plan(Policy.AUTO, 2.0, 0.0, OnInfeasible.REJECT)  # refusals stay on the bare predictions
    # Under load: the members' first step costs more than the load leaves a request (700 a second: 1 ms; members
    # 1.4, quick 0.95), so the quickest answers where nothing fits under caution, as without the quick fallback.
    loaded = wary(True)
    loaded.budget = Budget(utilization=0.7, rate=ArrivalRate(tau_s=1.0))
    _arrivals(loaded.budget, 700)
    assert loaded.plan(Policy.AUTO, 2.2, 0.0, OnInfeasible.REJECT).name == "quick"


def test_the_fastest_plan_is_chosen_on_the_profiles_not_on_online_estimates() -> None:
    """quick (p50 0.95 ms) is the quickest first step in the build's profile; its own recent runs were slow (an
    estimate of 50 ms) while the other engines, not run lately, keep their profiles: quick is still the fastest plan
    (the choice does not flip between engines with the estimates), planned with its own predicted time."""
    ladder = _auto_ladder()
    ladder.rungs.append(_record(Rung, "quick", 0.95, kind="exit", exit=1, val_accuracy=0.70, test_accuracy=0.7))
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    planner = Planner(ladder, predictor, margin_ms=1.0)
    assert planner.fastest(Policy.AUTO)[0].name == "quick"
    predictor._p90[("quick", 1)] = (time.monotonic(), 50.0)
    plan, first_ms = planner.fastest(Policy.AUTO)
    assert plan.name == "quick" and first_ms == pytest.approx(predictor.predict("quick")) and first_ms > 50.0


def test_a_caution_that_lets_only_the_quickest_through_gets_the_accurate_quick_step_too() -> None:
    # The ladder above: quick (p99 1.045 ms, val 0.70), fast and m1 (p99 1.1; val 0.80 and 0.82). At factor 2 with
    # 3.1 ms left and a 1 ms margin, quick fits under caution (2 x 1.045 <= 2.1) and nothing else does (2 x 1.1).
    ladder = _auto_ladder()
    ladder.rungs.append(_record(Rung, "quick", 0.95, kind="exit", exit=1, val_accuracy=0.70, test_accuracy=0.7))
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])

    def doubled(quick_fallback: bool) -> Planner:
        planner = Planner(ladder, predictor, 1.0, caution=Caution(step=1.0), quick_fallback=quick_fallback)
        planner.observe(Plan(Policy.AUTO, "quick", ["quick"]), -1.0)
        assert planner.factor(Policy.AUTO) == pytest.approx(2.0)
        return planner

    # As with more caution (the test above): the most accurate quick step, not the quickest alone.
    assert doubled(True).plan(Policy.AUTO, 3.1, 0.0, OnInfeasible.REJECT).name == "members"
    assert doubled(False).plan(Policy.AUTO, 3.1, 0.0, OnInfeasible.REJECT).name == "quick"  # the rule before
    # More room: a more accurate option fits under caution (slow, 2 x 22 ms) and answers on its own merit.
    assert doubled(True).plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "slow"
    # Where the quick step fits under caution it was weighed with the rest: a cheaper option tied with the best on
    # val (every option ties here) stands, though less accurate than the step.
    ladder.split_sizes = {"val": 100}
    tied = Planner(ladder, predictor, 1.0, caution=Caution(), tie_se=1e6)
    assert tied.plan(Policy.AUTO, 50.0, 0.0, OnInfeasible.REJECT).name == "quick"
    # The load leaves a request less than m1 costs: the cheapest option answers, as without the rule.
    loaded = doubled(True)
    loaded.budget = Budget(utilization=0.7, rate=ArrivalRate(tau_s=1.0))
    _arrivals(loaded.budget, 700)  # 1 ms a request (members costs 1.4, quick 0.95)
    assert loaded.plan(Policy.AUTO, 3.1, 0.0, OnInfeasible.REJECT).name == "quick"


def test_an_answer_ready_within_the_slack_counts_as_late_for_caution() -> None:
    ladder = _auto_ladder()
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs])
    near = Planner(ladder, predictor, margin_ms=1.0, caution=Caution(step=1.0, slack_ms=0.5))
    plan = Plan(Policy.AUTO, "fast", ["fast"])
    near.observe(plan, 0.6)  # 0.6 ms to spare: on time
    assert near.factor(Policy.AUTO) == 1.0
    near.observe(plan, 0.4)  # ready 0.4 ms before the deadline: within the slack, a near miss
    assert near.factor(Policy.AUTO) == pytest.approx(2.0)
    near.observe(plan, -math.inf)  # expired in the queue
    assert near.factor(Policy.AUTO) == pytest.approx(4.0)
    bare = Planner(ladder, predictor, margin_ms=1.0, caution=Caution(step=1.0, slack_ms=0.0))
    bare.observe(plan, 0.4)  # without a slack only answers late at the server count
    assert bare.factor(Policy.AUTO) == 1.0
    bare.observe(plan, -0.1)
    assert bare.factor(Policy.AUTO) == pytest.approx(2.0)


def test_caution_touches_only_auto() -> None:
    planner = _cautious_planner(3)  # factor 8
    assert planner.factor(Policy.AUTO) == pytest.approx(8.0)
    assert all(planner.factor(p) == 1.0 for p in (Policy.STATIC, Policy.CASCADE, Policy.FIXED))
    assert planner.plan(Policy.CASCADE, 70.0, 0.0, OnInfeasible.REJECT).name == "cascade"
    planner.observe(Plan(Policy.STATIC, "fast", ["fast"]), -1.0)  # another policy's late answer: no change
    assert planner.factor(Policy.AUTO) == pytest.approx(8.0)
    assert (
        _cautious_planner(0).caution is not None
        and Planner(_auto_ladder(), LatencyPredictor([]), 1.0).factor(Policy.AUTO) == 1.0
    )  # no caution given: bare predictions


def test_a_cautious_auto_cascade_stops_where_a_bare_one_goes_on() -> None:
    plan = Plan(Policy.AUTO, "members", ["m1", "m2"], [0.5], kind=PlanKind.MEMBERS)
    # After m1, unsure (top probability 0.2 < 0.5); m2's p99 is 1.1 ms; 3 ms left, margin 1 ms.
    assert _cautious_planner(0).continue_cascade(plan, 1, 0.2, 3.0, 0.0)  # 1.1 + 1 <= 3
    assert not _cautious_planner(1).continue_cascade(plan, 1, 0.2, 3.0, 0.0)  # 2 x 1.1 + 1 > 3


def test_an_auto_job_expiring_in_the_queue_raises_caution() -> None:
    scheduler, _, _ = _setup()  # its worker never starts: the test takes the batch itself
    planner = scheduler.planner
    planner.caution = Caution(step=1.0)
    done: list[Job] = []
    hopeless = _job(planner, Policy.AUTO, 5000, done)
    hopeless.deadline = time.monotonic() + 0.0015  # no plan fits 1.5 ms (margin 1 ms + 1.1 ms p99)
    scheduler.submit(hopeless)
    with scheduler._cond:
        assert scheduler._take_batch() == []
    assert isinstance(hopeless.error, DeadlineExpired)
    assert planner.factor(Policy.AUTO) == pytest.approx(2.0)


def _slowed(run: Callable[[np.ndarray], list[np.ndarray]], s: float) -> Callable[[np.ndarray], list[np.ndarray]]:
    def slow(x: np.ndarray) -> list[np.ndarray]:
        time.sleep(s)
        return run(x)

    return slow


def test_auto_answers_move_caution_where_they_are_sent(ladder_dir: Path, fmnist: FashionMNIST) -> None:
    """Through the app on the tiny ladder: an on-time auto answer lowers the factor, a late one raises it."""
    app = create_app(Settings(ladder=ladder_dir))
    image = png_base64(fmnist.split("test").head(1).images[0])
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        planner = app.state.runtime.planner
        planner.caution = Caution(step=1.0, target=0.25)  # up x2 per late answer, down x2 per three on time
        planner.observe(Plan(Policy.AUTO, "any", ["any"]), -1.0)
        on_time = client.post("/v1/classify", json={"image": image, "deadline_ms": 5000})
        assert on_time.status_code == 200 and on_time.json()["deadline_met"]
        assert planner.factor(Policy.AUTO) == pytest.approx(2 ** (2 / 3))
        for engine in app.state.runtime.engines.values():  # every engine now takes 5 ms more than a 2 ms deadline
            engine.run = _slowed(engine.run, 0.005)
        late = client.post("/v1/classify", json={"image": image, "deadline_ms": 2, "on_infeasible": "best_effort"})
        assert late.status_code == 200 and not late.json()["deadline_met"]
        assert planner.factor(Policy.AUTO) == pytest.approx(2 ** (5 / 3))
        families = text_string_to_metric_families(client.get("/metrics").text)
        gauges = {f.name: f.samples[0].value for f in families if f.samples}
        assert gauges["anytime_auto_caution"] == pytest.approx(2 ** (5 / 3))
