"""Plans: which engines a request runs, chosen from measured latency, the live queue and the time left.

Every way the ladder can answer is an *option*: a rung or an ensemble (one step), a stage cascade (the
stages of one network, each passing its features on), or a member cascade (rungs of different families,
each adding its answer to a stacker's combination). A multi-step option stops after step j when its answer
is confident enough, or when its next step no longer fits; so its value under a deadline is the accuracy
it reaches within the steps that fit (`accuracy_by_depth`, measured on val by the builder).

Policies: `auto` (the default) takes, per request, the cheapest option whose accuracy within the time left
is as good as the best's (within `tie_se` paired standard errors of val accuracy, `Ties`: the one-standard-error
rule), its predictions inflated by the caution its late answers have built up (service/caution.py); where
caution leaves no option, or only options less accurate than it, the most accurate of the quickest first steps
(typically no slower than the quickest one at its p99);
`static` the most accurate single rung that fits whole; `cascade` the most accurate stage cascade;
`fixed` the option the request names. The others stay for baselines.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from engines.manifest import (
    Cascade,
    Ensemble,
    Ladder,
    MemberCascade,
    Rung,
    accuracy_stderr,
    paired_stderrs,
    unpack_right,
)
from models.compat import StrEnum
from service.caution import Caution
from service.errors import DeadlineInfeasible, OutOfService, UnknownRung
from service.load import Budget
from service.predictor import LatencyPredictor

# Combines the logits of the members run so far into the answer's logits (a member cascade's stacker).
Combiner = Callable[[Sequence[np.ndarray]], np.ndarray]
# An option's steps as predicted now: when each step ends (each at its p99, after the ones before it), and what the
# steps up to each cost a request on average (Planner._steps).
Steps = tuple[list[float], list[float]]
# What the planner keeps for one LatencyPredictor.version (Planner._table): the version, each option's Steps, auto's
# choice for each (place of the budget among all step ends, place of the cap among all costs), and those ends and costs.
Kept = tuple[int, dict[str, Steps], dict[tuple[int, int], "Option | None"], list[tuple[list[float], list[float]]]]


class Policy(StrEnum):
    AUTO = "auto"
    CASCADE = "cascade"
    STATIC = "static"
    FIXED = "fixed"


class OnInfeasible(StrEnum):
    REJECT = "reject"
    BEST_EFFORT = "best_effort"


class PlanKind(StrEnum):
    RUNG = "rung"  # one engine: a rung or an ensemble
    STAGES = "stages"  # a stage cascade: step k runs on step k-1's features; gate: entropy <= threshold
    MEMBERS = "members"  # a member cascade: every step runs on the image; gate: top probability >= threshold


@dataclass
class Plan:
    policy: Policy
    name: str  # the option that answers
    engines: list[str]  # engine names, run in order (one for a rung)
    thresholds: list[float] = field(default_factory=list)  # after step j < k: stop when the gate passes
    feasible: bool = True  # False: best-effort run of the fastest plan, the deadline cannot be met
    kind: PlanKind = PlanKind.RUNG
    members: list[str] = field(default_factory=list)  # a member cascade's rungs (its engines), an ensemble's


@dataclass
class Option:
    """One way to answer, as the planner weighs it."""

    name: str
    kind: PlanKind
    engines: list[str]
    accuracy_by_depth: list[float]  # val accuracy when at most j steps run (j = 1..len(engines))
    thresholds: list[float] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    served: bool = True  # not dominated (or dominated ones are served too)
    reach: list[float] = field(default_factory=lambda: [1.0])  # how often step j runs (a cascade stops early)
    right_by_depth: list[str] = field(default_factory=list)  # val images answered right at each depth (packed)

    def plan(self, policy: Policy) -> Plan:
        return Plan(policy, self.name, list(self.engines), list(self.thresholds), True, self.kind, list(self.members))


def _rung_option(r: Rung | Ensemble, include_dominated: bool) -> Option:
    members = list(r.members) if isinstance(r, Ensemble) else []
    served = include_dominated or not r.dominated
    return Option(r.name, PlanKind.RUNG, [r.name], [r.val_accuracy], [], members, served, [1.0], r.val_right_by_depth)


def _reach(shares: Sequence[float], steps: int) -> list[float]:
    """How often each step runs, from the share of answers given after each step (measured by the builder)."""
    if len(shares) != steps:
        return [1.0] * steps
    return [max(0.0, 1.0 - s) for s in accumulate([0.0, *shares[:-1]])]


def _stage_option(c: Cascade) -> Option:
    k = len(c.stages)
    # Without recorded depths, only the whole cascade is credited (a shorter run answers, but unmeasured).
    by_depth = list(c.val_accuracy_by_depth) or [0.0] * (k - 1) + [c.val_accuracy]
    reach = _reach(c.expected_exit_share, k)
    right = list(c.val_right_by_depth)
    return Option(c.name, PlanKind.STAGES, list(c.stages), by_depth, list(c.thresholds), [], True, reach, right)


def _member_option(c: MemberCascade, include_dominated: bool) -> Option:
    served = include_dominated or not c.dominated
    return Option(
        c.name,
        PlanKind.MEMBERS,
        list(c.members),
        list(c.val_accuracy_by_depth),
        list(c.thresholds),
        list(c.members),
        served,
        _reach(c.test_exit_share, len(c.members)),
        list(c.val_right_by_depth),
    )


class Ties:
    """Which val accuracies count as equal: within `tie_se` standard errors of the difference.

    Where the ladder records which val images each option (at each depth) answers right, the standard error is the
    paired one (engines.manifest.paired_stderrs), computed for every pair once, here: two options that agree on
    most images are told apart by a far smaller difference than either accuracy's own standard error. Otherwise,
    and for ladders built before the records, it is the binomial standard error of the better accuracy,
    sqrt(p (1 - p) / n)."""

    def __init__(self, options: Sequence[Option], images: int, tie_se: float) -> None:
        self.tie_se, self.images = tie_se, images
        self.row: dict[tuple[str, int], int] = {}
        rows: list[np.ndarray] = []
        for o in options:
            if images and len(o.right_by_depth) == len(o.accuracy_by_depth):
                for depth, packed in enumerate(o.right_by_depth, 1):
                    self.row[(o.name, depth)] = len(rows)
                    rows.append(unpack_right(packed, images))
        if rows:
            self.se: list[list[float]] = paired_stderrs(np.asarray(rows)).tolist()  # plain floats: read per plan

    def margin(self, accuracy: float, a: tuple[str, int], b: tuple[str, int]) -> float:
        """How far below `accuracy` (option a's, at its depth) option b may be and still count as equal to a."""
        i, j = self.row.get(a), self.row.get(b)
        if i is not None and j is not None:
            return self.tie_se * self.se[i][j]
        return self.tie_se * accuracy_stderr(accuracy, self.images)


class Planner:
    def __init__(
        self,
        ladder: Ladder,
        predictor: LatencyPredictor,
        margin_ms: float,
        include_dominated: bool = False,
        caution: Caution | None = None,
        budget: Budget | None = None,
        tie_se: float = 0.0,
        quick_fallback: bool = True,
    ) -> None:
        self.predictor, self.margin_ms = predictor, margin_ms
        self.quick_fallback = quick_fallback  # False: where nothing fits under caution, the fastest first step
        self.caution = caution  # None: auto plans on the bare predictions
        self.budget = budget  # None: auto ignores the load (service/load.py)
        answers: list[Rung | Ensemble] = [*ladder.rungs, *ladder.ensembles]
        rungs = [_rung_option(r, include_dominated) for r in answers]
        stages = [_stage_option(c) for c in ladder.cascades]
        members = [_member_option(c, include_dominated) for c in ladder.member_cascades]
        self.options = {o.name: o for o in [*rungs, *stages, *members]}
        self.static = sorted((o for o in rungs if o.served), key=lambda o: -o.accuracy_by_depth[0])
        self.cascades = sorted(stages, key=lambda o: -o.accuracy_by_depth[-1])
        self.auto = [o for o in self.options.values() if o.served]
        # auto's resolution: val accuracies within tie_se standard errors of the best count as equal (0: none).
        self.ties = Ties(self.auto, ladder.split_sizes.get("val", 0), tie_se)
        self.out: set[str] = set()  # engines taken out of service (they failed)
        # Jobs accepted and not finished (the scheduler's depth, wired by service/runtime.py): while one is, an
        # engine may be mid-run, so the predictor's estimates are not dropped as idle (see plan).
        self.in_flight: Callable[[], int] = lambda: 0
        self._quick: dict[frozenset[str], Option | None] = {}  # _quick_and_accurate's, per set of engines out
        # For the predictions of one LatencyPredictor.version: each option's predicted steps (_steps), auto's choice
        # for each way its options fit, and the bounds between those ways (_best_within). One tuple, replaced whole:
        # plans on two threads.
        self._kept: Kept = (-1, {}, {}, [])

    def take_out(self, engine: str) -> None:
        """An engine failed: no plan uses it from now on."""
        self.out.add(engine)
        self._kept = (-1, {}, {}, [])  # auto's choices were made among its options

    def _usable(self, options: list[Option]) -> list[Option]:
        if not self.out:
            return options
        return [o for o in options if not self.out.intersection(o.engines)]

    @property
    def rungs(self) -> dict[str, Option]:
        """Every option a `fixed` request may name."""
        return self.options

    def fits(self, engines: list[str], time_left_ms: float, wait_ms: float, factor: float = 1.0) -> bool:
        return factor * (wait_ms + sum(self.predictor.predict(e) for e in engines)) + self.margin_ms <= time_left_ms

    def factor(self, policy: Policy) -> float:
        """How far this policy's predictions are inflated now: auto's caution, else 1."""
        return self.caution.factor if policy is Policy.AUTO and self.caution is not None else 1.0

    def observe(self, plan: Plan, slack_ms: float) -> None:
        """An answer planned by `plan` was ready `slack_ms` before its deadline (negative: after it; -inf: it
        expired before it could run)."""
        if plan.policy is Policy.AUTO:
            if self.caution is not None:
                self.caution.answered(slack_ms)
            if self.budget is not None:
                self.budget.answered(slack_ms)

    def _table(self) -> Kept:
        """The options' predicted steps (`_steps`), auto's choices and their bounds (`_best_within`) for the
        predictions as they stand now: kept until one changes."""
        version = self.predictor.version
        kept = self._kept
        if kept[0] != version:
            kept = self._kept = (version, {}, {}, [])
        return kept

    def _steps(self, option: Option, table: dict[str, Steps]) -> Steps:
        """The option's Steps, from `table` or worked out into it: each step ends at its predicted p99; its cost is its
        engine's median in the build's profile (ms of engine time on an idle machine) weighted by how often the step
        runs. Options that share an engine share its prediction.

        The costs rank the options against each other and against the load's budget, whose restraint (service/load.py)
        learns how far the machine's contention stretches them. They used to be the online predictions' typical times:
        an engine that runs under load has estimates of its own, the others the pooled slowdown applied to their
        profiles, which a fast engine's fixed-length stalls exceed. So whichever cheap option `auto` used looked dearer
        than the ones it had not used lately, and its choice moved among them: in the sweep of 2026-11-28 at 800 req/s
        and 5 ms, `auto`'s answers came from seven plans (runs that could not share a batch), and its effective
        accuracy was 29.5 %, against 61.6 % for fixed ResNet exit 1 INT8 alone."""
        steps = table.get(option.name)
        if steps is None:
            predictor = self.predictor
            ends, costs, elapsed, cost = [], [], 0.0, 0.0
            for reach, engine in zip(option.reach, option.engines, strict=True):
                elapsed += predictor.predict(engine)
                cost += reach * predictor.profiled_p50(engine)
                ends.append(elapsed)
                costs.append(cost)
            steps = table[option.name] = (ends, costs)
        return steps

    def steps_within(self, option: Option, budget_ms: float) -> tuple[int, float]:
        """How many of the option's steps fit in `budget_ms` (each at its predicted p99), and what those steps cost
        a request on average (ms of engine time: each step's median in the build's profile, weighted by how often the
        step runs)."""
        ends, costs = self._steps(option, self._table()[1])
        depth = bisect_right(ends, budget_ms)
        return depth, costs[depth - 1] if depth else 0.0

    def depth_within(self, option: Option, budget_ms: float) -> int:
        """How many of the option's steps fit in `budget_ms` (each at its predicted p99)."""
        return self.steps_within(option, budget_ms)[0]

    def _named(self, name: str | None) -> Option:
        if name is None or name not in self.options:
            raise UnknownRung(f"unknown rung {name!r}; see GET /v1/ladder for the rungs", rung=name)
        option = self.options[name]
        if self.out.intersection(option.engines):
            raise OutOfService(f"rung {name} is out of service (its engine failed); another policy can answer")
        return option

    def cost(self, option: Option) -> float:
        """What the whole option costs a request on average (ms of engine time), as `steps_within` counts it."""
        return self.steps_within(option, float("inf"))[1]

    def _best_within(
        self, options: list[Option], budget_ms: float, cost_cap_ms: float = float("inf"), remember: bool = False
    ) -> Option | None:
        """The option worth most within the time budget: the cheapest (average cost) of those whose accuracy
        at the depth that fits is within `ties` of the best's, then the more accurate.

        Options whose average cost is over `cost_cap_ms` (what the load leaves a request) are left out; when
        every option that fits is over it, the one that costs least answers.

        The choice depends only on how many steps of each option fit and whether that is over the cap, and so
        only on where the budget falls among every option's step ends and the cap among their costs. With
        `remember` (auto's options in service, the only list plan passes), it is kept for each such place until the
        predictions change: a request then costs two bisections, not a pass over the options and the weighing
        (bench.planner; tests/test_properties.py checks the kept choices against choices weighed afresh).
        """
        _, table, choices, bounds = self._table()
        if remember:
            if not bounds:  # worked out once per version (two threads may both: the same values)
                steps = [table.get(o.name) or self._steps(o, table) for o in options]
                bounds.append((sorted({e for s in steps for e in s[0]}), sorted({c for s in steps for c in s[1]})))
            ends_all, costs_all = bounds[0]
            key = (bisect_right(ends_all, budget_ms), bisect_right(costs_all, cost_cap_ms))
            if key in choices:
                return choices[key]
        fit: list[int] = []  # per option: the steps that fit; negative when they cost more than the cap
        for option in options:
            ends, costs = table.get(option.name) or self._steps(option, table)
            depth = bisect_right(ends, budget_ms)
            fit.append(-depth if depth and costs[depth - 1] > cost_cap_ms else depth)
        choice = self._weigh(options, fit, table)
        if remember:
            choices[key] = choice
        return choice

    def _weigh(self, options: list[Option], fit: list[int], table: dict[str, Steps]) -> Option | None:
        """_best_within's choice, given each option's fit."""
        cheapest, least = None, float("inf")
        reachable: list[tuple[float, float, Option, int]] = []  # (accuracy at the depth that fits, cost, option, depth)
        for option, depth in zip(options, fit, strict=True):
            if depth == 0:
                continue
            cost = table[option.name][1][abs(depth) - 1]
            if depth < 0:
                if cost < least:
                    cheapest, least = option, cost
                continue
            reachable.append((option.accuracy_by_depth[depth - 1], cost, option, depth))
        if not reachable:
            return cheapest
        best, _, top, top_depth = max(reachable, key=lambda r: r[0])
        a = (top.name, top_depth)
        tied = [r for r in reachable if best - r[0] <= self.ties.margin(best, a, (r[2].name, r[3]))]
        return min(tied, key=lambda r: (r[1], -r[0]))[2]

    def _quick_and_accurate(self) -> Option | None:
        """Where caution leaves auto no option: the most accurate first step among the quickest, those whose typical
        time is within the quickest first step's p99. From the builder's profiles, not the online predictions: those
        predict the engines not run lately from the others' slowdown, which overstates them and would lock the
        choice in. Worked out once per set of engines out of service; None when auto has no option in service."""
        key = frozenset(self.out)
        if key not in self._quick:
            options = self._usable(self.auto)
            p50 = {o.name: self.predictor.profiled_p50(o.engines[0]) for o in options}
            quickest = min(options, key=lambda o: p50[o.name], default=None)
            chosen = None
            if quickest is not None:
                within = self.predictor.prior(quickest.engines[0], 1)  # its p99
                quick = [o for o in options if p50[o.name] <= within]
                chosen = max(quick, key=lambda o: (o.accuracy_by_depth[0], -p50[o.name]))
            self._quick[key] = chosen
        return self._quick[key]

    def _no_worse_than_quick(
        self, chosen: Option | None, cautious_ms: float, budget_ms: float, cap_ms: float
    ) -> Option | None:
        """auto's choice under caution, or the most accurate quick first step (_quick_and_accurate) where caution left
        that step out and only options less accurate than it at the depth that fits, or none, and the step's bare
        prediction fits `budget_ms` (and its average cost the load's `cap_ms`). The quick first steps typically take no
        longer than the quickest at its p99: a caution that lets the quickest through cannot tell them from it.
        Without this, a caution that left only the quickest first step answered with it, and a greater one, leaving
        nothing, with the more accurate quick step: more caution, a more accurate answer. Where the step fits under
        caution, it was weighed with the rest (_best_within) and the choice stands. Where it costs more than the load
        leaves a request, it does not answer: with nothing left under caution, the fastest plan does. Before, it
        answered there whatever the load (the sweep of 2026-11-28: MobileNetV2 FP32, within ResNet exit 1 INT8's p99,
        for most of `auto`'s requests at 400-600 req/s and 5 ms, with caution at its ceiling)."""
        quick = self._quick_and_accurate()
        if quick is None or quick is chosen or self.cost(quick) > cap_ms:
            return chosen  # None: the fastest plan, or a refusal (plan)
        if chosen is not None:
            depth = max(1, self.depth_within(chosen, cautious_ms))  # >= 1 when _best_within chose it
            if (
                chosen.accuracy_by_depth[depth - 1] >= quick.accuracy_by_depth[0]
                or self.depth_within(quick, cautious_ms) > 0
            ):
                return chosen
        if self.predictor.predict(quick.engines[0]) > budget_ms:
            return chosen  # None: the fastest plan, or a refusal (plan)
        return quick

    def fastest(self, policy: Policy, rung: str | None = None) -> tuple[Plan, float]:
        """The quickest plan this policy allows (its first step's median in the build's profile) and its predicted time
        to a first answer (ms). Chosen on the profiles for the reason _steps costs on them: on the online predictions
        the choice moved to whichever first step `auto` had not run lately."""
        if policy is Policy.FIXED:
            option = self._named(rung)
        else:
            pool = {Policy.AUTO: self.auto, Policy.CASCADE: self.cascades, Policy.STATIC: self.static}[policy]
            usable = self._usable(pool)
            if not usable:
                raise OutOfService(f"no {policy} plan is in service: its engines failed")
            option = min(usable, key=lambda o: self.predictor.profiled_p50(o.engines[0]))
        return option.plan(policy), self.predictor.predict(option.engines[0])

    def plan(
        self,
        policy: Policy,
        time_left_ms: float,
        wait_ms: float,
        on_infeasible: OnInfeasible,
        rung: str | None = None,
        restrain: bool = True,
    ) -> Plan:
        """The best plan that fits; else the fastest, best-effort or rejected (DeadlineInfeasible). Before it refuses,
        the predictor drops estimates that the engines have all but stopped refreshing (far more requests refused on
        them than runs lately, and no job in flight: LatencyPredictor.forget_if_starved).

        auto: over every served option, the cheapest whose accuracy reachable in time is within `ties` of the
        best's, with the queue wait and each step's prediction multiplied by the caution factor (a cascade counts
        for the steps that fit); where none fits so, or only options less accurate than it, the most accurate quick
        first step (_no_worse_than_quick), if its bare prediction fits. static: the most accurate rung that fits
        whole. cascade: the most accurate stage cascade that fits whole, else the one whose first stage is quickest
        (it stops early when time runs out). fixed: the named option, if its first step fits.

        An auto request refused because the queue ahead left no plan (it would fit an empty one) counts in the load
        restraint (service/load.py); `restrain` False: not, for a request planned again and already counted.
        """
        budget = time_left_ms - wait_ms - self.margin_ms
        if policy is Policy.AUTO:
            cautious = (time_left_ms - self.margin_ms) / self.factor(policy) - wait_ms  # factor x (wait + steps)
            cap = self.budget.ms() if self.budget is not None else float("inf")
            chosen = self._best_within(self._usable(self.auto), cautious, cap, remember=True)
            if self.quick_fallback:
                chosen = self._no_worse_than_quick(chosen, cautious, budget, cap)
            if chosen is not None:
                return chosen.plan(policy)
        elif policy is Policy.STATIC:
            for option in self._usable(self.static):
                if self.depth_within(option, budget) == 1:
                    return option.plan(policy)
        elif policy is Policy.CASCADE:
            for option in self._usable(self.cascades):
                if self.depth_within(option, budget) == len(option.engines):
                    return option.plan(policy)
        fastest, first_ms = self.fastest(policy, rung)
        if first_ms <= budget:
            return fastest
        if self.in_flight() == 0 and self.predictor.forget_if_starved():  # refusals, next to no runs: the profiles
            return self.plan(policy, time_left_ms, wait_ms, on_infeasible, rung, restrain)
        if restrain and policy is Policy.AUTO and self.budget is not None and first_ms + self.margin_ms <= time_left_ms:
            self.budget.refused_for_the_queue()  # the queue ahead, not the deadline, left no plan: load restraint
        if on_infeasible is OnInfeasible.BEST_EFFORT:
            fastest.feasible = False
            return fastest
        needs = wait_ms + first_ms + self.margin_ms
        raise DeadlineInfeasible(
            f"no plan can answer within {time_left_ms:.2f} ms: the fastest needs about {needs:.2f} ms (queue "
            f"{wait_ms:.2f}, engine {first_ms:.2f}, margin {self.margin_ms:.2f})",
            fastest_ms=round(needs, 3),
        )

    def continue_cascade(self, plan: Plan, done: int, score: float, time_left_ms: float, wait_ms: float) -> bool:
        """After step `done` (1-based) of a cascade: go on only if unsure and the next step still fits.

        `score` is the gate's: entropy for a stage cascade (unsure above the threshold), the top probability
        for a member cascade (unsure below it).
        """
        if done >= len(plan.engines):
            return False
        threshold = plan.thresholds[done - 1]
        sure = score <= threshold if plan.kind is PlanKind.STAGES else score >= threshold
        if sure:
            return False
        return not plan.feasible or self.fits([plan.engines[done]], time_left_ms, wait_ms, self.factor(plan.policy))
