"""Member cascades, searched on val: which members run in which order, and when the answer so far is
confident enough to stop.

A member cascade runs rungs of different families one after another (a cheap accurate one first). After
member j it combines the members so far (member 1 alone; then the mean of their probabilities) and stops once
the combination's top probability reaches that step's threshold, or when the next member no longer fits the
deadline (the planner's call). For every order of 2..`max_members` candidates, the thresholds are the cheapest
(expected cost on val, from the members' batch-1 p50) whose answers differ from running every member on at
most `bound_pp` percent of val: the accuracy bound, stated as agreement. (In the offline probe that led here,
an accuracy bound on 5,000 val images picked thresholds where val happened to lose nothing and test lost
0.15-0.2 pp; the agreement rate carried over to test: 0.12 % of test answers differed where val allowed 0.1 %.)
The cascades kept are drawn from those no other beats on both val accuracy and expected cost, as `auto` chooses
among them (service/planner.py): val accuracies within `tie_se` paired standard errors (of the difference, over
the same val images: engines.manifest.paired_stderrs) of the most accurate count as equal, and of such a group only
the cheapest is kept, or rather, of those whose expected cost is within `cost_tie` (10 %) of the cheapest's, the
most accurate on val; then the next group below it, up to `keep` cascades. Expected costs come from batch-1
profiles that move 4-7 % between builds (engines/steps/measure.py), and the orders of a group often lie within a
few % of each other: on the ladder of 2026-11-26 (afternoon) the three cheapest of the top group's five cost 0.219,
0.225 and 0.226 ms. Taking the cheapest outright, 40 builds simulated with that profile noise (sd 5 % on each
member's p50) kept 5 different cascades, the commonest in 24; with the 10 % cost tie, 2, the commonest in 38. Over
20 random halvings of val, choosing on one half and scoring on the other, the cost tie scored +0.06 pp (6 better,
3 worse, 11 the same) at 1.32x against 1.28x VGG INT8's expected cost. Each kept cascade records which val
images it answers right at each depth, for the planner's paired ties. (On
the ladder of 2026-11-25 the five most accurate of the 9 on the front lay within 0.06 pp of val accuracy, 3
images of 5,000, at an expected 1.44-2.67 ms; keeping them, as before, dropped the cheaper ones, 1.00-1.30 ms,
MobileNetV2 then VGG with or without a third member.)

Orders and thresholds are chosen on val only; the test split is read afterwards, once per kept cascade, to
report accuracy and exit shares and to measure the cost: the cascade is run image by image at batch 1 over
the whole test split, members, combination and gate included, and its mean and p99 recorded.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engines.base import Backend, Engine, softmax
from engines.ensemble import soft_vote
from engines.factory import open_engine
from engines.manifest import Ensemble, MemberCascade, Rung, pack_right, paired_stderrs
from engines.steps.context import BuildContext, machine_key
from engines.steps.evaluate import engine_logits

SOFT_VOTE = "soft_vote"
# Candidate thresholds on the top probability: stop whenever it is at least this (1.01: never stop there).
GRID = (*np.round(np.linspace(0.5, 0.95, 19), 3).tolist(), 0.97, 0.98, 0.99, 0.995, 0.999, 1.01)


@dataclass(frozen=True)
class MemberCascadeConfig:
    max_members: int = 3
    bound_pp: float = 0.1  # % of val answers that may differ from running every member (>= the accuracy lost)
    keep: int = 5  # at most this many cascades from the val accuracy / expected cost front
    tie_se: float = 1.0  # val accuracies within this many standard errors count as equal: the cheaper is kept
    cost_tie: float = 0.10  # expected costs within this fraction of the group's cheapest count as equal too


@dataclass
class Found:
    order: tuple[str, ...]
    thresholds: list[float]  # after member j < k
    val_accuracy: float
    val_accuracy_by_depth: list[float]
    val_full_accuracy: float  # every member run
    val_exit_share: list[float]
    expected_ms: float  # on val, from the members' batch-1 p50
    val_right_by_depth: list[np.ndarray]  # per val image, answered right (bool) when at most j members run


def _steps(probs: Mapping[str, np.ndarray], order: Sequence[str]) -> list[np.ndarray]:
    """The combined probabilities after each member: member 1 alone, then the mean of the first j."""
    out, total = [], np.zeros_like(probs[order[0]])
    for j, m in enumerate(order, 1):
        total = total + probs[m]
        out.append(total / j)
    return out


def _thresholds(
    steps: list[np.ndarray], labels: np.ndarray, costs: list[float], bound: float
) -> tuple[list[float], float, float, list[float]] | None:
    """The cheapest thresholds whose answers differ from the last step's on at most `bound` of the images.

    Returns (thresholds, accuracy, expected cost, share answered after each step), or None. Two or three steps.
    """
    grid = np.asarray(GRID)
    n = len(labels)
    top = [p.max(axis=1) for p in steps]
    preds = [p.argmax(axis=1) for p in steps]
    right = [(p == labels).astype(np.float64) for p in preds]
    differ = [(p != preds[-1]).astype(np.float64) for p in preds]
    a = (top[0][:, None] >= grid[None, :]).astype(np.float64)  # stop after step 1: (n, t1)
    if len(steps) == 2:
        acc = (a * right[0][:, None] + (1 - a) * right[1][:, None]).mean(axis=0)[:, None]
        diff = (a * differ[0][:, None]).mean(axis=0)[:, None]
        reach2, reach3 = (1 - a).mean(axis=0)[:, None], np.zeros((len(grid), 1))
        cost = costs[0] + reach2 * costs[1]
    else:
        b = (top[1][:, None] >= grid[None, :]).astype(np.float64)  # stop after step 2: (n, t2)
        acc = (
            (a * right[0][:, None]).mean(axis=0)[:, None]
            + ((1 - a).T @ (b * right[1][:, None])) / n
            + ((1 - a).T @ ((1 - b) * right[2][:, None])) / n
        )
        diff = (a * differ[0][:, None]).mean(axis=0)[:, None] + ((1 - a).T @ (b * differ[1][:, None])) / n
        reach2, reach3 = (1 - a).mean(axis=0)[:, None], ((1 - a).T @ (1 - b)) / n
        cost = costs[0] + reach2 * costs[1] + reach3 * costs[2]
    ok = np.argwhere(diff <= bound + 1e-12)
    if not len(ok):
        return None
    i, j = ok[np.argmin(cost[ok[:, 0], ok[:, 1]])]
    thresholds = [float(grid[i])] + ([float(grid[j])] if len(steps) == 3 else [])
    r2, r3 = float(reach2[i, 0]), float(reach3[i, j])
    shares = [1 - r2, r2 - r3, r3] if len(steps) == 3 else [1 - r2, r2]
    return thresholds, float(acc[i, j]), float(cost[i, j]), shares


def simulate(
    steps: list[np.ndarray], thresholds: list[float], depth: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(the step that answers each image, its prediction) when at most `depth` steps may run."""
    depth = depth or len(steps)
    n = len(steps[0])
    at = np.full(n, depth - 1)
    undecided = np.ones(n, bool)
    for j in range(depth - 1):
        stop = undecided & (steps[j].max(axis=1) >= thresholds[j])
        at[stop] = j
        undecided &= ~stop
    preds = np.stack([s.argmax(axis=1) for s in steps[:depth]])[at, np.arange(n)]
    return at, preds


def search(
    val_logits: Mapping[str, np.ndarray], labels: np.ndarray, costs: Mapping[str, float], config: MemberCascadeConfig
) -> list[Found]:
    """Every order of 2..max_members candidates; the front of val accuracy against expected cost."""
    probs = {m: softmax(np.asarray(z, np.float64)) for m, z in val_logits.items()}
    bound = config.bound_pp / 100
    found = []
    for k in range(2, min(config.max_members, 3, len(probs)) + 1):
        for order in itertools.permutations(sorted(probs), k):
            steps = _steps(probs, order)
            chosen = _thresholds(steps, labels, [costs[m] for m in order], bound)
            if chosen is None:
                continue
            thresholds, accuracy, cost, shares = chosen
            right = [simulate(steps, thresholds, d)[1] == labels for d in range(1, k + 1)]
            by_depth = [float(r.mean()) for r in right]
            full = float((steps[-1].argmax(axis=1) == labels).mean())
            found.append(Found(order, thresholds, accuracy, by_depth, full, shares, cost, right))
    return front(found, config.keep, config.tie_se, config.cost_tie)


def front(found: list[Found], keep: int, tie_se: float = 0.0, cost_tie: float = 0.0) -> list[Found]:
    """The cascades no other beats on both val accuracy and expected cost, thinned by ties: from the most
    accurate down, those within `tie_se` paired standard errors of the group's most accurate form a group, of
    which the cheapest is kept, or, of those within `cost_tie` of the cheapest's expected cost, the most accurate
    on val; at most `keep`, the most accurate groups first."""
    on_front = [
        f
        for f in found
        if not any(
            g.val_accuracy >= f.val_accuracy
            and g.expected_ms <= f.expected_ms
            and (g.val_accuracy > f.val_accuracy or g.expected_ms < f.expected_ms)
            for g in found
        )
    ]
    if not on_front:
        return []
    rest = sorted(range(len(on_front)), key=lambda i: (-on_front[i].val_accuracy, on_front[i].expected_ms))
    se = paired_stderrs(np.asarray([f.val_right_by_depth[-1] for f in on_front]))
    accuracy = [f.val_accuracy for f in on_front]
    kept: list[int] = []
    while rest and len(kept) < keep:
        head = rest[0]
        group = [i for i in rest if accuracy[head] - accuracy[i] <= tie_se * se[head, i]]
        cheapest = min(on_front[i].expected_ms for i in group)
        near = [i for i in group if on_front[i].expected_ms <= cheapest * (1 + cost_tie)]
        kept.append(max(near, key=lambda i: (accuracy[i], -on_front[i].expected_ms)))
        rest = [i for i in rest if i not in group]
    return [on_front[i] for i in kept]


def candidates(rungs: list[Rung], bases: list[Rung]) -> list[Rung]:
    """The ensemble bases (the last exit and each member, INT8 unless it loses too much) and the fastest exit:
    the cheap first member a cascade of other families can start from."""
    exits = [r for r in rungs if r.kind == "exit" and r.backend is Backend.ONNXRUNTIME]
    fastest = min(exits, key=lambda r: r.profile(1).p50_ms)
    return [*bases, *([fastest] if fastest.name not in {b.name for b in bases} else [])]


def _name(order: Sequence[str]) -> str:
    return "members." + "+".join(m.split(".")[0] + ("" if ".int8." in m else ".fp32") for m in order)


def time_cascade(engines: Sequence[Engine], images: np.ndarray, thresholds: Sequence[float]) -> np.ndarray:
    """Seconds per image of a member cascade run image by image (batch 1), gate and combination included: the
    member engines, a softmax, the mean of the probabilities so far, the top-probability test. One engine and
    no thresholds times a single rung the same way."""
    samples = np.empty(len(images))
    clock = time.perf_counter
    for i in range(len(images)):
        x = images[i : i + 1]
        start = clock()
        outputs = []
        for j, engine in enumerate(engines):
            outputs.append(engine.infer(x))
            combined = softmax(outputs[0]) if j == 0 else soft_vote(outputs)
            if j < len(thresholds) and combined.max() >= thresholds[j]:
                break
        samples[i] = clock() - start
    return samples


def measure_cascade(ctx: BuildContext, members: list[Rung], thresholds: list[float]) -> tuple[float, float]:
    """Mean and p99 ms of the cascade over the test split (`time_cascade`)."""
    images = ctx.inputs.spec.normalize(ctx.inputs.split("test").images).astype(np.float32)
    engines = [
        open_engine(r.backend, ctx.out / r.artifact.path, r.precision, ctx.threads, r.artifact.sha256) for r in members
    ]
    try:
        for e in engines:
            e.warmup((1,), runs=5)
        samples = time_cascade(engines, images, thresholds)
    finally:
        for e in engines:
            e.close()
    return float(samples.mean() * 1e3), float(np.percentile(samples, 99) * 1e3)


def build_member_cascades(
    ctx: BuildContext,
    rungs: list[Rung],
    bases: list[Rung],
    ensembles: list[Ensemble],
    config: MemberCascadeConfig,
) -> list[MemberCascade]:
    """Search on val, report on test, measure end to end; mark those a rung or ensemble dominates."""
    pool = candidates(rungs, bases)
    if len(pool) < 2:
        return []
    by_name = {r.name: r for r in pool}
    logits = {
        r.name: engine_logits(ctx, ctx.out / r.artifact.path, r.backend, r.precision, ("val", "test")) for r in pool
    }
    val, test = ctx.inputs.split("val"), ctx.inputs.split("test")
    costs = {r.name: r.profile(1).p50_ms for r in pool}
    found = search({n: z["val"] for n, z in logits.items()}, val.labels, costs, config)
    cascades = []
    for f in found:
        members = [by_name[m] for m in f.order]
        test_steps = _steps({m: softmax(logits[m]["test"].astype(np.float64)) for m in f.order}, f.order)
        at, preds = simulate(test_steps, f.thresholds)
        key = {
            "members": [m.artifact.sha256 for m in members],
            "thresholds": f.thresholds,
            "test": test.fingerprint,
            "threads": ctx.threads,
            "machine": machine_key(),
            "versions": ctx.versions,
        }

        def measure(members: list[Rung] = members, thresholds: list[float] = f.thresholds) -> tuple[float, float]:
            return measure_cascade(ctx, members, thresholds)

        mean_ms, p99_ms = ctx.cache.run(f"measure/{_name(f.order)}", key, measure)
        cascades.append(
            MemberCascade(
                name=_name(f.order),
                members=list(f.order),
                combiners=[SOFT_VOTE] * (len(f.order) - 1),  # type: ignore[list-item]
                stackers=[None] * (len(f.order) - 1),
                thresholds=f.thresholds,
                accuracy_bound_pp=config.bound_pp,
                fit_split="val",
                fit_fingerprint=val.fingerprint,
                val_accuracy=f.val_accuracy,
                test_accuracy=float((preds == test.labels).mean()),
                val_accuracy_by_depth=f.val_accuracy_by_depth,
                val_right_by_depth=[pack_right(r) for r in f.val_right_by_depth],
                test_exit_share=(np.bincount(at, minlength=len(f.order)) / len(at)).tolist(),
                test_mean_ms=mean_ms,
                test_p99_ms=p99_ms,
            )
        )
    served: list[Rung | Ensemble] = [r for r in rungs if not r.dominated]
    served += [e for e in ensembles if not e.dominated]
    mark_dominated(cascades, served)
    return cascades


def mark_dominated(cascades: list[MemberCascade], served: Sequence[Rung | Ensemble]) -> None:
    """Mark each cascade that a served rung or ensemble, or another cascade (by measured mean), dominates."""
    for c in cascades:
        better: list[Rung | Ensemble | MemberCascade] = [r for r in served if dominates_cascade(r, c)]
        better += [o for o in cascades if o is not c and _beats(o, c)]
        c.dominated = bool(better)
        c.dominated_by = max(better, key=lambda r: r.val_accuracy).name if better else None


def _beats(o: MemberCascade, c: MemberCascade) -> bool:
    """As accurate on val and cheaper by measured mean, or more accurate and no dearer."""
    return (
        o.val_accuracy >= c.val_accuracy
        and o.test_mean_ms <= c.test_mean_ms
        and (o.val_accuracy > c.val_accuracy or o.test_mean_ms < c.test_mean_ms)
    )


def dominates_cascade(r: Rung | Ensemble, c: MemberCascade) -> bool:
    """A rung or ensemble at least as accurate on val and no slower (its batch-1 p50 against the cascade's
    measured mean) leaves a member cascade nothing to add."""
    return r.val_accuracy >= c.val_accuracy and r.profile(1).p50_ms <= c.test_mean_ms
