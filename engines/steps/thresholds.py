"""Entropy thresholds for the anytime cascade, fitted on the val split."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engines.base import entropy

MAX_COMBINATIONS = 20_000


@dataclass(frozen=True)
class CascadeFit:
    thresholds: list[float]
    exit_share: list[float]
    mean_cost_ms: float
    accuracy: float
    last_exit_accuracy: float


def simulate(exit_logits: list[np.ndarray], thresholds: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Which exit answers each input and its prediction: the first exit whose entropy <= its threshold."""
    n, k = len(exit_logits[0]), len(exit_logits)
    exit_at, _ = _stops([entropy(lg) for lg in exit_logits[: len(thresholds)]], thresholds, k, n)
    preds = np.stack([lg.argmax(1) for lg in exit_logits])[exit_at, np.arange(n)]
    return exit_at, preds


def _stops(ents: list[np.ndarray], thresholds: Sequence[float], k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(the exit each of n inputs leaves at, whether it is still undecided) after the first len(thresholds)
    exits' gates; an input no gate stops leaves at the last exit, k - 1."""
    exit_at = np.full(n, k - 1)
    undecided = np.ones(n, bool)
    for i, t in enumerate(thresholds):
        stop = undecided & (ents[i] <= t)
        exit_at[stop] = i
        undecided &= ~stop
    return exit_at, undecided


def fit_thresholds(
    exit_logits: list[np.ndarray], labels: np.ndarray, stage_ms: list[float], bound_pp: float = 0.5
) -> CascadeFit:
    """Cheapest thresholds (expected cost from stage latencies) whose accuracy >= last exit's - bound.

    A grid search over entropy quantiles of each exit (plus "never stop here"), at most
    MAX_COMBINATIONS combinations; the all-never combination reproduces the last exit, so a fit always exists.
    The last threshold's whole grid is scored at once per combination of the others (`_last_threshold`), which
    took the default ladder's fit from 0.6 s to a few ms.
    """
    k = len(exit_logits)
    if len(stage_ms) != k:
        raise ValueError(f"{len(stage_ms)} stage latencies for {k} exits")
    preds = np.stack([lg.argmax(1) for lg in exit_logits])
    correct = preds == labels[None]
    last_acc = float(correct[-1].mean())
    cum_ms = np.cumsum(stage_ms)
    if k == 1:
        return CascadeFit([], [1.0], float(cum_ms[0]), last_acc, last_acc)
    ents = [entropy(lg) for lg in exit_logits[:-1]]
    points = max(5, int(MAX_COMBINATIONS ** (1 / max(1, k - 1))))
    grids = [np.array([-1.0, *np.unique(np.quantile(e, np.linspace(0, 1, points))).tolist()]) for e in ents]
    target = last_acc - bound_pp / 100
    n = len(labels)
    best: tuple[float, float, list[float]] | None = None
    for prefix in itertools.product(*grids[:-1]):
        exit_at, undecided = _stops(ents, prefix, k, n)
        found = _last_threshold(ents[-1], grids[-1], correct, cum_ms, exit_at, undecided, target)
        if found is not None and (best is None or found[0] < best[0] or (found[0] == best[0] and found[1] > best[1])):
            best = (found[0], found[1], [*map(float, prefix), found[2]])
    assert best is not None  # the all-(-1) combination is the last exit itself
    cost, acc, chosen = best
    exit_at, _ = _stops(ents, chosen, k, n)
    share = np.bincount(exit_at, minlength=k) / n
    return CascadeFit(chosen, share.tolist(), cost, acc, last_acc)


def _last_threshold(
    ent: np.ndarray,
    grid: np.ndarray,
    correct: np.ndarray,
    cum_ms: np.ndarray,
    exit_at: np.ndarray,
    undecided: np.ndarray,
    target: float,
) -> tuple[float, float, float] | None:
    """(cost, accuracy, threshold) of the cheapest threshold of exit k-2 in `grid` (ties: the more accurate, then
    the first) given the earlier exits' choice (`exit_at`, `undecided`); None if none reaches `target`.

    The undecided inputs that stop at exit k-2 under threshold t are those of entropy <= t: a prefix of them
    sorted by entropy, so every threshold's count of right answers and stops comes from one cumulative sum.
    """
    k, n = len(cum_ms), len(exit_at)
    decided, left = ~undecided, ent[undecided]
    base_hits = int(correct[exit_at[decided], np.flatnonzero(decided)].sum())
    base_ms = float(np.bincount(exit_at[decided], minlength=k) @ cum_ms)
    order = np.argsort(left, kind="stable")
    sorted_ent = left[order]
    gain = correct[k - 2][undecided][order].astype(np.int64) - correct[k - 1][undecided][order]
    stops = np.searchsorted(sorted_ent, grid, side="right")  # undecided inputs that stop at exit k-2
    hits = base_hits + int(correct[k - 1][undecided].sum()) + np.concatenate([[0], np.cumsum(gain)])[stops]
    acc = hits / n
    cost = (base_ms + stops * cum_ms[k - 2] + (len(sorted_ent) - stops) * cum_ms[k - 1]) / n
    ok = np.flatnonzero(acc >= target)
    if len(ok) == 0:
        return None
    j = ok[np.lexsort((ok, -acc[ok], cost[ok]))[0]]  # cheapest, then most accurate, then first
    return float(cost[j]), float(acc[j]), float(grid[j])
