"""Stacker benchmark: every ensemble the builder tried, combined every reasonable way, against the best single
INT8 rung, all on the built ladder's INT8 member engines in this one run.

Method: each member rung of the ladder's ensembles predicts the full val (5,000) and test (10,000) splits once.
Fitted combiners are scored on val out-of-fold (stratified 5-fold, as the builder chooses its stacker) and on
test after a refit on all of val; fixed combiners (soft vote, geometric mean) need no fit and are scored on
val and test directly. Combiners: the builder's two candidates (logistic regression and an MLP over the
members' probabilities), logistic regression with ten times stronger regularization, logistic regression
over log-probabilities, the mean of probabilities (soft vote) and the mean of log-probabilities.

    python -m bench.stackers [--ladder ladders/default]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import softmax
from engines.ensemble import StackerKind, member_features, soft_vote
from engines.factory import open_record
from engines.manifest import load_ladder
from engines.steps.evaluate import accuracy, predict_logits
from engines.steps.stacker import FOLDS, candidate
from models.data import FashionMNIST, PreprocessSpec


def _log_probs(logits: list[np.ndarray]) -> np.ndarray:
    return np.log(np.clip(member_features(logits), 1e-12, None))


def _logistic(c: float) -> Callable[[], Any]:
    from sklearn.linear_model import LogisticRegression

    return lambda: LogisticRegression(C=c, max_iter=3000)


# name -> (features from the members' logits, a new unfitted estimator)
FITTED: dict[str, tuple[Callable[[list[np.ndarray]], np.ndarray], Callable[[], Any]]] = {
    "LR": (member_features, lambda: candidate(StackerKind.LOGISTIC, 0)),
    "MLP": (member_features, lambda: candidate(StackerKind.MLP, 0)),
    "LR C=0.1": (member_features, _logistic(0.1)),
    "LR log-p": (_log_probs, _logistic(1.0)),
}
FIXED: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "soft vote": soft_vote,
    "geo mean": lambda zs: np.mean([np.log(np.clip(softmax(z), 1e-12, None)) for z in zs], axis=0),
}


def score_fitted(make: Callable[[], Any], xv: np.ndarray, yv: np.ndarray, xt: np.ndarray, yt: np.ndarray) -> tuple:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        oof = cross_val_predict(make(), xv, yv, cv=StratifiedKFold(FOLDS, shuffle=True, random_state=0))
        test = make().fit(xv, yv).predict(xt)
    return float((oof == yv).mean()), float((test == yt).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    args = parser.parse_args()
    ladder = load_ladder(args.ladder)
    if not ladder.ensemble_search:
        raise SystemExit(f"{args.ladder} has no ensembles (built without members?)")
    spec = PreprocessSpec.from_dict(ladder.preprocess)
    data = FashionMNIST()
    val, test = data.split("val"), data.split("test")
    logits = {}
    for name in sorted({m for e in ladder.ensemble_search for m in e.members}):
        engine = open_record(args.ladder, ladder, ladder.rung(name), ladder.threads)
        logits[name] = predict_logits(engine, val, spec), predict_logits(engine, test, spec)
        engine.close()
    int8 = [r for r in ladder.rungs if r.precision == "int8"]  # none where the probe found INT8 does not pay
    best = max(int8 or ladder.rungs, key=lambda r: r.test_accuracy)
    print(
        f"best single {'INT8 ' if int8 else ''}rung: {best.name}, test {best.test_accuracy:.2%}; target +0.5 pp = "
        f"{best.test_accuracy + 0.005:.2%}"
    )
    print("each cell: val (out-of-fold for fitted combiners) / test, in %; * marks the builder's choice")
    methods = [*FITTED, *FIXED]
    print(f"{'members':<40}" + "".join(f"{m:>16}" for m in methods))
    best_test = dict.fromkeys(methods, 0.0)
    for tried in ladder.ensemble_search:
        zv, zt = [logits[m][0] for m in tried.members], [logits[m][1] for m in tried.members]
        cells = {}
        for name, (features, make) in FITTED.items():
            cells[name] = score_fitted(make, features(zv), val.labels, features(zt), test.labels)
        for name, combine in FIXED.items():
            cells[name] = (accuracy(combine(zv), val.labels), accuracy(combine(zt), test.labels))
        chosen = "LR" if tried.stacker == StackerKind.LOGISTIC else "MLP"
        label = "+".join(m.split(".")[0] for m in tried.members)
        row = "".join(
            f"{('*' if m == chosen else '') + f'{v * 100:.2f}/{t * 100:.2f}':>16}" for m, (v, t) in cells.items()
        )
        print(f"{label:<40}{row}")
        for m, (_, t) in cells.items():
            best_test[m] = max(best_test[m], t)
    print("best test over all member sets, minus the best single INT8 rung (pp; the max over test is optimistic):")
    print("  " + ", ".join(f"{m} {(t - best.test_accuracy) * 100:+.2f}" for m, t in best_test.items()))


if __name__ == "__main__":
    main()
