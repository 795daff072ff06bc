"""Plans: which engines a request runs, chosen from measured latency, the live queue and the time left."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from engines.manifest import Cascade, Ensemble, Ladder, Rung
from service.errors import DeadlineInfeasible, UnknownRung
from service.predictor import LatencyPredictor


class Policy(StrEnum):
    CASCADE = "cascade"
    STATIC = "static"
    FIXED = "fixed"


class OnInfeasible(StrEnum):
    REJECT = "reject"
    BEST_EFFORT = "best_effort"


@dataclass
class Plan:
    policy: Policy
    name: str  # the rung or cascade that answers
    engines: list[str]  # engine names, run in order (one for a rung, the stages for a cascade)
    thresholds: list[float] = field(default_factory=list)  # cascade: stop after stage k if entropy <= t_k
    feasible: bool = True  # False: best-effort run of the fastest plan, the deadline cannot be met


class Planner:
    def __init__(
        self, ladder: Ladder, predictor: LatencyPredictor, margin_ms: float, include_dominated: bool = False
    ) -> None:
        self.predictor, self.margin_ms = predictor, margin_ms
        # Ensembles are rungs like any other: a static plan or a fixed request may name one.
        answers: list[Rung | Ensemble] = [*ladder.rungs, *ladder.ensembles]
        self.rungs = {r.name: r for r in answers}
        candidates = [r for r in self.rungs.values() if include_dominated or not r.dominated]
        self.static = sorted(candidates, key=lambda r: -r.val_accuracy)
        self.cascades = sorted(ladder.cascades, key=lambda c: -c.val_accuracy)

    def fits(self, engines: list[str], time_left_ms: float, wait_ms: float) -> bool:
        return wait_ms + sum(self.predictor.predict(e) for e in engines) + self.margin_ms <= time_left_ms

    def _rung_plan(self, policy: Policy, rung: Rung | Ensemble) -> Plan:
        return Plan(policy, rung.name, [rung.name])

    def _cascade_plan(self, cascade: Cascade) -> Plan:
        return Plan(Policy.CASCADE, cascade.name, list(cascade.stages), list(cascade.thresholds))

    def fastest(self, policy: Policy, rung: str | None = None) -> tuple[Plan, float]:
        """The quickest plan this policy allows and its predicted time to a first answer (ms)."""
        if policy is Policy.FIXED:
            plan = self._rung_plan(policy, self._named(rung))
            return plan, self.predictor.predict(plan.engines[0])
        if policy is Policy.CASCADE:
            plans = [self._cascade_plan(c) for c in self.cascades]
        else:
            plans = [self._rung_plan(policy, r) for r in self.static]
        plan = min(plans, key=lambda p: self.predictor.predict(p.engines[0]))
        return plan, self.predictor.predict(plan.engines[0])

    def _named(self, rung: str | None) -> Rung | Ensemble:
        if rung is None or rung not in self.rungs:
            raise UnknownRung(f"unknown rung {rung!r}; see GET /v1/ladder for the rungs", rung=rung)
        return self.rungs[rung]

    def plan(
        self, policy: Policy, time_left_ms: float, wait_ms: float, on_infeasible: OnInfeasible, rung: str | None = None
    ) -> Plan:
        """The most accurate plan that fits; else the fastest, best-effort or rejected (DeadlineInfeasible).

        static: the most accurate rung whose predicted p99 fits whole. cascade: the most accurate cascade
        that fits whole, else the one whose first stage is quickest (it stops early when time runs out).
        """
        if policy is Policy.STATIC:
            for r in self.static:
                if self.fits([r.name], time_left_ms, wait_ms):
                    return self._rung_plan(policy, r)
        elif policy is Policy.CASCADE:
            for c in self.cascades:
                if self.fits(list(c.stages), time_left_ms, wait_ms):
                    return self._cascade_plan(c)
        fastest, first_ms = self.fastest(policy, rung)
        if policy is not Policy.FIXED and self.fits(fastest.engines[:1], time_left_ms, wait_ms):
            return fastest
        if policy is Policy.FIXED and self.fits(fastest.engines, time_left_ms, wait_ms):
            return fastest
        if on_infeasible is OnInfeasible.BEST_EFFORT:
            fastest.feasible = False
            return fastest
        margin = self.margin_ms
        needs = wait_ms + first_ms + margin
        raise DeadlineInfeasible(
            f"no plan can answer within {time_left_ms:.2f} ms: the fastest needs about {needs:.2f} ms (queue "
            f"{wait_ms:.2f}, engine {first_ms:.2f}, margin {margin:.2f})",
            fastest_ms=round(needs, 3),
        )

    def continue_cascade(self, plan: Plan, done: int, entropy: float, time_left_ms: float, wait_ms: float) -> bool:
        """After stage `done` (1-based) of a cascade: go on only if unsure and the next stage still fits."""
        if done >= len(plan.engines) or entropy <= plan.thresholds[done - 1]:
            return False
        return not plan.feasible or self.fits([plan.engines[done]], time_left_ms, wait_ms)
