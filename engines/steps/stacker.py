"""Stacker fitting and export (offline): LR or MLP chosen by cross-validated accuracy, written as ONNX by skl2onnx.

The runtime side (engines/ensemble.py) only opens and runs the exported file; nothing here is imported by
the server.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from engines.ensemble import STACKER_INPUT, StackerKind

FOLDS = 5
# The settings every build uses (part of the stacker step's cache key). The MLP stops once 10 % of its training
# data held out has not improved for 10 epochs (scikit-learn's early_stopping). Side by side on the default
# ladder's 4 ensembles (2026-11-25, 5-fold CV on val, then a refit, one thread): 300 fixed epochs took 25.6-28.8
# s a stacker, early stopping 1.5-2.5 s (15-18 epochs), and its CV accuracy was higher on 3 of the 4 (94.64 %
# against 94.04 % for exit 3, DenseNet, VGG; the fixed epochs overfit) and 0.14 pp lower on one.
SETTINGS: dict[StackerKind, dict[str, Any]] = {
    StackerKind.LOGISTIC: {"C": 1.0, "max_iter": 2000},
    StackerKind.MLP: {"hidden_layer_sizes": (64,), "alpha": 1e-3, "max_iter": 300, "early_stopping": True},
}


def candidate(kind: StackerKind, seed: int) -> Any:
    """An unfitted estimator of `kind` with the settings every build uses."""
    if kind is StackerKind.LOGISTIC:
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(**SETTINGS[kind])
    from sklearn.neural_network import MLPClassifier

    return MLPClassifier(**SETTINGS[kind], random_state=seed)


@dataclass
class StackerFit:
    kind: StackerKind
    estimator: Any  # the chosen candidate, fitted on all of the features
    cv_accuracy: dict[str, float]  # each candidate's out-of-fold accuracy
    oof_predictions: np.ndarray  # the chosen candidate's out-of-fold labels


def out_of_fold(
    kind: StackerKind, features: np.ndarray, labels: np.ndarray, seed: int = 0, jobs: int = 1
) -> np.ndarray:
    """Out-of-fold labels of one candidate (stratified k-fold, shuffled with `seed`; folds in `jobs` processes)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from threadpoolctl import threadpool_limits

    folds = StratifiedKFold(FOLDS, shuffle=True, random_state=seed)
    # One BLAS thread: on 2 vCPUs, OpenBLAS's spinning threads made a logistic-regression CV 10x slower
    # (17.9 s vs 1.8 s for three members) whenever the other core was busy.
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)  # the MLP stops at max_iter; CV measures the result
        predictions: np.ndarray = cross_val_predict(
            candidate(kind, seed), features, labels, cv=folds, n_jobs=jobs if jobs > 1 else None
        )
    return predictions


def fit_stacker(
    features: np.ndarray,
    labels: np.ndarray,
    seed: int = 0,
    kinds: tuple[StackerKind, ...] = tuple(StackerKind),
    jobs: int = 1,
) -> StackerFit:
    """Choose among `kinds` by stratified k-fold accuracy (out-of-fold), then refit the winner on everything.

    The MLP's folds (seconds each) run in `jobs` processes; logistic regression's (milliseconds) in this one.
    """
    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    oof = {kind: out_of_fold(kind, features, labels, seed, jobs if kind is StackerKind.MLP else 1) for kind in kinds}
    scores = {str(k): float((p == labels).mean()) for k, p in oof.items()}
    best = max(kinds, key=lambda k: scores[str(k)])  # ties keep the first: logistic regression
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator = candidate(best, seed).fit(features, labels)
    return StackerFit(best, estimator, scores, oof[best])


def export_stacker(estimator: Any, n_features: int, path: Path) -> Path:
    """skl2onnx export: float input, no ZipMap, so the graph outputs (label, float probabilities)."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    onx = to_onnx(
        estimator,
        initial_types=[(STACKER_INPUT, FloatTensorType([None, n_features]))],
        options={id(estimator): {"zipmap": False}},
        target_opset={"": 18, "ai.onnx.ml": 3},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(onx.SerializeToString())
    return path


def stacker_versions() -> dict[str, str]:
    """From the installed packages' metadata: importing skl2onnx to read its version took 3.6 s of a 17 s
    rebuild with nothing to do."""
    return {name: version(name) for name in ("scikit-learn", "skl2onnx")}
