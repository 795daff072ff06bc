"""Entropy thresholds for the anytime cascade, fitted on the val split."""

from __future__ import annotations

import itertools
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
    exit_at = np.full(n, k - 1)
    undecided = np.ones(n, bool)
    for i, t in enumerate(thresholds):
        stop = undecided & (entropy(exit_logits[i]) <= t)
        exit_at[stop] = i
        undecided &= ~stop
    preds = np.stack([lg.argmax(1) for lg in exit_logits])[exit_at, np.arange(n)]
    return exit_at, preds


def fit_thresholds(
    exit_logits: list[np.ndarray], labels: np.ndarray, stage_ms: list[float], bound_pp: float = 0.5
) -> CascadeFit:
    """Cheapest thresholds (expected cost from stage latencies) whose accuracy >= last exit's - bound.

    A grid search over entropy quantiles of each exit (plus "never stop here"), at most
    MAX_COMBINATIONS combinations; the all-never combination reproduces the last exit, so a fit always exists.
    """
    k = len(exit_logits)
    if len(stage_ms) != k:
        raise ValueError(f"{len(stage_ms)} stage latencies for {k} exits")
    ents = [entropy(lg) for lg in exit_logits[:-1]]
    points = max(5, int(MAX_COMBINATIONS ** (1 / max(1, k - 1))))
    grids = [[-1.0, *np.unique(np.quantile(e, np.linspace(0, 1, points))).tolist()] for e in ents]
    preds = np.stack([lg.argmax(1) for lg in exit_logits])
    correct = preds == labels[None]
    last_acc = float(correct[-1].mean())
    target = last_acc - bound_pp / 100
    cum_ms = np.cumsum(stage_ms)
    n = len(labels)
    best: tuple[float, float, list[float], np.ndarray] | None = None
    for combo in itertools.product(*grids):
        exit_at = np.full(n, k - 1)
        undecided = np.ones(n, bool)
        for i, t in enumerate(combo):
            stop = undecided & (ents[i] <= t)
            exit_at[stop] = i
            undecided &= ~stop
        acc = float(correct[exit_at, np.arange(n)].mean())
        if acc < target:
            continue
        cost = float(cum_ms[exit_at].mean())
        if best is None or cost < best[0] or (cost == best[0] and acc > best[1]):
            best = (cost, acc, list(combo), exit_at)
    assert best is not None  # the all-(-1) combination is the last exit itself
    cost, acc, chosen, exit_at = best
    share = np.bincount(exit_at, minlength=k) / n
    return CascadeFit([float(t) for t in chosen], share.tolist(), cost, acc, last_acc)
