from __future__ import annotations

import numpy as np

from engines.base import entropy
from engines.steps.thresholds import fit_thresholds, simulate


def test_entropy_bounds() -> None:
    assert np.allclose(entropy(np.zeros((1, 10))), np.log(10))
    assert entropy(np.array([[100.0, 0, 0]]))[0] < 1e-6


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
