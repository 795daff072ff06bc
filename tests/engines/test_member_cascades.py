"""Member cascades: the vectorised threshold search against a brute-force simulation, the front, dominance by
measured cost, and the timing loop's early stop (fake engines count their calls)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engines.base import softmax
from engines.manifest import MemberCascade
from engines.steps.member_cascades import (
    GRID,
    Found,
    MemberCascadeConfig,
    _steps,
    front,
    mark_dominated,
    search,
    simulate,
    time_cascade,
)

COSTS = {"a": 0.1, "b": 0.5, "c": 0.9}


def _members(n: int = 600, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Three members right on 80-90 % of the images, each sure of itself where it is right (mostly)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, n)
    logits = {}
    for name, p_right in (("a", 0.8), ("b", 0.85), ("c", 0.9)):
        right = rng.random(n) < p_right
        z = rng.normal(0, 0.5, (n, 5))
        target = np.where(right, labels, (labels + 1) % 5)
        z[np.arange(n), target] += np.where(right, rng.uniform(1, 5, n), rng.uniform(0, 2, n))
        logits[name] = z
    return logits, labels


def _brute_force(steps: list[np.ndarray], costs: list[float], bound: float) -> float:
    """The cheapest expected cost over every threshold tuple of the grid whose answers differ from the last step's
    on at most `bound` of the images: a loop over simulate(), no matrix algebra."""
    best = np.inf
    full = steps[-1].argmax(axis=1)
    for t in itertools.product(GRID, repeat=len(steps) - 1):
        at, preds = simulate(steps, list(t))
        if (preds != full).mean() <= bound + 1e-12:
            reach = [(at >= j).mean() for j in range(len(steps))]
            best = min(best, sum(c * r for c, r in zip(costs, reach, strict=True)))
    return best


@pytest.mark.parametrize("bound_pp", [0.0, 1.0, 5.0])
def test_search_thresholds_hold_the_bound_and_are_the_cheapest(bound_pp: float) -> None:
    logits, labels = _members()
    probs = {m: softmax(z) for m, z in logits.items()}
    found = search(logits, labels, COSTS, MemberCascadeConfig(bound_pp=bound_pp, keep=100))
    assert found
    for f in found:
        steps = _steps(probs, f.order)
        at, preds = simulate(steps, f.thresholds)
        assert (preds != steps[-1].argmax(axis=1)).mean() <= bound_pp / 100 + 1e-12
        assert f.val_accuracy == pytest.approx((preds == labels).mean())
        assert f.val_exit_share == pytest.approx((np.bincount(at, minlength=len(f.order)) / len(at)).tolist())
        costs = [COSTS[m] for m in f.order]
        assert f.expected_ms == pytest.approx(_brute_force(steps, costs, bound_pp / 100))
        assert f.val_accuracy_by_depth[-1] == pytest.approx(f.val_accuracy)


def test_a_looser_bound_is_never_dearer() -> None:
    logits, labels = _members(seed=1)
    tight = {f.order: f.expected_ms for f in search(logits, labels, COSTS, MemberCascadeConfig(bound_pp=0.0, keep=100))}
    loose = {f.order: f.expected_ms for f in search(logits, labels, COSTS, MemberCascadeConfig(bound_pp=5.0, keep=100))}
    shared = tight.keys() & loose.keys()
    assert shared and all(loose[o] <= tight[o] + 1e-12 for o in shared)


def _found(name: str, ms: float, right: np.ndarray) -> Found:
    acc = float(right.mean())
    return Found((name, "x"), [0.9], acc, [acc, acc], acc, [0.9, 0.1], ms, [right, right])


def _right(first: int, last: int, n: int = 5000, wrong: tuple[int, ...] = ()) -> np.ndarray:
    """Right on images first..last-1 of n, but for those in `wrong`."""
    right = np.zeros(n, bool)
    right[first:last] = True
    right[list(wrong)] = False
    return right


def test_front_keeps_what_nothing_beats_on_both_most_accurate_first() -> None:
    p, q, r, s = _right(0, 4750), _right(0, 4700), _right(0, 4700), _right(0, 4650)
    kept = front([_found("p", 0.5, p), _found("q", 0.2, q), _found("r", 0.3, r), _found("s", 0.6, s)], keep=5)
    assert [f.order[0] for f in kept] == ["p", "q"]  # r: q as accurate and cheaper; s: p beats it on both
    assert [f.order[0] for f in front([_found("p", 0.5, p), _found("q", 0.2, q)], keep=1)] == ["p"]


def test_front_ties_only_what_the_paired_standard_error_cannot_tell_apart() -> None:
    """On 5,000 val images p is right on 95.0 %. r (94.92 %) is right on 96 images p gets wrong and wrong on 92 it
    gets right: 4 images apart, well within the paired standard error (0.27 pp), so p and r tie and the cheaper, r,
    is kept. q (94.90 %) is p but wrong on 5 more images: a consistent loss (paired standard error 0.045 pp), no
    tie, though both are within one binomial standard error (0.31 pp) of p. t is off the front (q beats it)."""
    p, r = _found("p", 2.0, _right(0, 4750)), _found("r", 1.5, _right(96, 4842))
    q, t = _found("q", 1.0, _right(0, 4750, wrong=(1, 2, 3, 4, 5))), _found("t", 1.2, _right(0, 4740))
    assert [f.order[0] for f in front([p, r, q, t], keep=5, tie_se=1.0)] == ["r", "q"]
    assert [f.order[0] for f in front([p, r, q, t], keep=1, tie_se=1.0)] == ["r"]
    assert [f.order[0] for f in front([p, r, q, t], keep=5, tie_se=0.0)] == ["p", "r", "q"]
    assert [f.order[0] for f in front([p, r, q, t], keep=5, tie_se=3.0)] == ["q"]  # 3 x 0.045 pp > 0.1 pp


def test_of_a_tie_group_costs_within_the_cost_tie_count_as_equal_and_val_accuracy_decides() -> None:
    """p, q and r tie on val (a few images apart, within the paired standard error). q is the cheapest; r costs 3 %
    more, within profile noise, and is more accurate on val, so with a 10 % cost tie r is kept; p costs 20 % more and
    stays out of the cost tie though it is the most accurate."""
    p, q, r = _right(0, 4760), _right(60, 4812), _right(40, 4798)
    group = [_found("p", 1.20, p), _found("q", 1.00, q), _found("r", 1.03, r)]
    assert [f.order[0] for f in front(group, keep=1, tie_se=1.0)] == ["q"]  # no cost tie: the cheapest
    assert [f.order[0] for f in front(group, keep=1, tie_se=1.0, cost_tie=0.10)] == ["r"]
    assert [f.order[0] for f in front(group, keep=1, tie_se=1.0, cost_tie=0.25)] == ["p"]
    assert [f.order[0] for f in front(group, keep=1, tie_se=0.0, cost_tie=0.10)] == ["p"]  # no accuracy tie


def _cascade(name: str, val: float, mean_ms: float) -> MemberCascade:
    return MemberCascade.model_construct(name=name, val_accuracy=val, test_mean_ms=mean_ms, dominated=False)


def test_a_cascade_as_accurate_but_slower_by_measured_mean_is_dominated() -> None:
    # The search ranks by expected cost from p50s; the measured mean can reverse two orders of the same members.
    fast, slow, other = _cascade("fast", 0.9486, 0.405), _cascade("slow", 0.9486, 0.520), _cascade("o", 0.95, 0.9)
    mark_dominated([fast, slow, other], served=[])
    assert (fast.dominated, slow.dominated, other.dominated) == (False, True, False)
    assert slow.dominated_by == "fast"


class _CountingEngine:
    """Fake engine: fixed logits per image (row i of `table` for input value i), counts its calls."""

    def __init__(self, table: np.ndarray) -> None:
        self.table, self.calls = table, 0

    def infer(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.table[int(x[0, 0])][None]


def test_time_cascade_runs_the_next_member_only_when_unsure() -> None:
    n = 10
    sure, unsure = np.array([10.0, 0, 0]), np.array([0.1, 0, 0])
    first = _CountingEngine(np.stack([sure if i % 2 == 0 else unsure for i in range(n)]))
    second = _CountingEngine(np.tile(sure, (n, 1)))
    images = np.arange(n, dtype=np.float32).reshape(n, 1)
    samples = time_cascade([first, second], images, [0.9])  # type: ignore[list-item]
    assert (first.calls, second.calls) == (n, n // 2) and len(samples) == n and (samples > 0).all()
