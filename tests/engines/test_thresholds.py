from __future__ import annotations

import itertools

import numpy as np
import pytest

from engines.base import entropy, probs_entropy, row_softmax, softmax
from engines.steps.thresholds import fit_thresholds, simulate


def test_entropy_bounds() -> None:
    assert np.allclose(entropy(np.zeros((1, 10))), np.log(10))
    assert entropy(np.array([[100.0, 0, 0]]))[0] < 1e-6


def test_one_rows_softmax_in_python_floats_matches_numpys() -> None:
    rng = np.random.default_rng(0)
    rows = [*(rng.normal(0, s, 10).astype(np.float32) for s in (0.1, 3.0, 30.0)), np.zeros(10, np.float32)]
    rows.append(np.array([80.0, -80.0, 0.0], np.float32))  # probabilities far under the clip floor
    for row in rows:
        probs, h = row_softmax(row.tolist())
        expected = softmax(row[None].astype(np.float64))[0]
        assert np.allclose(probs, expected, rtol=1e-12, atol=1e-300)
        assert h == pytest.approx(float(probs_entropy(expected)), rel=1e-12, abs=1e-15)
        assert h == pytest.approx(float(entropy(row[None])[0]), rel=1e-12, abs=1e-15)
        assert int(np.argmax(probs)) == int(np.argmax(row))


def _synthetic(n: int = 2000, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Exit 1 is confident and right on 'easy' inputs, unsure elsewhere; exit 3 is right on 95 %."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    easy = rng.random(n) < 0.6

    def logits(sharp: np.ndarray, right: np.ndarray) -> np.ndarray:
        out = rng.normal(0, 0.1, (n, 10))
        target = np.where(right, labels, (labels + 1) % 10)
        out[np.arange(n), target] += sharp
        return out

    e1 = logits(np.where(easy, 8.0, 0.5), easy | (rng.random(n) < 0.3))
    e2 = logits(np.where(easy, 8.0, 2.0), easy | (rng.random(n) < 0.7))
    e3 = logits(np.full(n, 6.0), rng.random(n) < 0.95)
    return [e1, e2, e3], labels


def test_fit_keeps_accuracy_within_bound_and_saves_cost() -> None:
    exits, labels = _synthetic()
    fit = fit_thresholds(exits, labels, [1.0, 1.0, 1.0], bound_pp=0.5)
    assert fit.accuracy >= fit.last_exit_accuracy - 0.005
    assert fit.exit_share[0] > 0.4  # the easy inputs leave at exit 1
    assert fit.mean_cost_ms < 3.0
    exit_at, preds = simulate(exits, fit.thresholds)
    assert np.isclose((preds == labels).mean(), fit.accuracy)
    assert np.allclose(np.bincount(exit_at, minlength=3) / len(labels), fit.exit_share)


def test_zero_bound_never_loses_accuracy() -> None:
    exits, labels = _synthetic(seed=1)
    fit = fit_thresholds(exits, labels, [1.0, 2.0, 3.0], bound_pp=0.0)
    assert fit.accuracy >= fit.last_exit_accuracy


def _brute_force(
    exit_logits: list[np.ndarray], labels: np.ndarray, stage_ms: list[float], bound_pp: float
) -> tuple[float, float, list[float]]:
    """Every combination of the same grids scored one by one: the search `fit_thresholds` vectorises."""
    k = len(exit_logits)
    ents = [entropy(lg) for lg in exit_logits[:-1]]
    points = max(5, int(20_000 ** (1 / max(1, k - 1))))
    grids = [[-1.0, *np.unique(np.quantile(e, np.linspace(0, 1, points))).tolist()] for e in ents]
    correct = np.stack([lg.argmax(1) for lg in exit_logits]) == labels[None]
    target, cum_ms = correct[-1].mean() - bound_pp / 100, np.cumsum(stage_ms)
    best: tuple[float, float, list[float]] | None = None
    n = len(labels)
    for combo in itertools.product(*grids):
        exit_at, undecided = np.full(n, k - 1), np.ones(n, bool)
        for i, t in enumerate(combo):
            stop = undecided & (ents[i] <= t)
            exit_at[stop] = i
            undecided &= ~stop
        acc = correct[exit_at, np.arange(len(labels))].mean()
        cost = cum_ms[exit_at].mean()
        if acc >= target and (
            best is None or cost < best[0] - 1e-12 or (abs(cost - best[0]) <= 1e-12 and acc > best[1])
        ):
            best = (cost, acc, list(combo))
    return best


@pytest.mark.parametrize(("k", "bound"), [(1, 0.5), (2, 0.0), (3, 0.5), (3, 2.0)])
def test_the_vectorised_search_finds_what_trying_every_combination_finds(k: int, bound: float) -> None:
    rng = np.random.default_rng(k)
    n = 300
    labels = rng.integers(0, 10, n)
    exits = [rng.normal(size=(n, 10)) + np.eye(10)[labels] * rng.uniform(0.5, 4) for _ in range(k)]
    stage_ms = rng.uniform(0.1, 1.0, k).tolist()
    fit = fit_thresholds(exits, labels, stage_ms, bound)
    cost, acc, chosen = _brute_force(exits, labels, stage_ms, bound)
    assert fit.thresholds == chosen
    assert fit.mean_cost_ms == pytest.approx(cost) and fit.accuracy == pytest.approx(acc)
