"""Ensemble rungs: which member sets to try (a greedy search on val), their stackers, and their measured cost.

Search (`forward_selection`): greedy forward selection, started from every base rung: from {b}, add the
base that most improves the out-of-fold val accuracy of a logistic-regression stacker, and stop when no
addition gains. Every set is scored once (memoized). Starting from every base rather than only the best
one costs O(n^3) fits instead of 1, still far from the 2^n subsets for many members, and it finds sets
whose first step is not the best pair (today's best set, exit3+densenet+vgg, starts from exit3).

Only the sets that could be on the accuracy/latency front are then timed (`prune`): a set is dropped when
a rung, or another tried set, is at least as accurate and no slower by the estimate (the sum of the
members' p50 at every batch size; measured ensembles cost about that). The sets that remain get the full
stacker choice (logistic regression or MLP by cross-validated accuracy), are exported and measured end to
end like any rung.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import Backend, Precision
from engines.ensemble import StackerKind, StackerSession, member_features, soft_vote
from engines.factory import concurrent_members, open_ensemble
from engines.manifest import Ensemble, EnsembleTried, LatencyProfile, Rung, pack_right
from engines.steps.context import BuildContext, machine_key
from engines.steps.evaluate import accuracy, engine_logits
from engines.steps.measure import ProfileConfig, measure_latency, measure_peak_memory
from engines.steps.stacker import (
    FOLDS,
    SETTINGS,
    candidate,
    export_stacker,
    fit_stacker,
    out_of_fold,
    stacker_versions,
)

Members = tuple[str, ...]


@dataclass(frozen=True)
class EnsembleConfig:
    int8_max_drop_pp: float = 1.0  # a member whose INT8 rung loses more val accuracy joins ensembles in FP32
    seed: int = 0
    starts: str = "every"  # "every": forward selection from every base; "best": from the best base only
    stackers: tuple[StackerKind, ...] = tuple(StackerKind)  # the kinds cross-validation chooses among


def forward_selection(
    bases: Sequence[str], single: dict[str, float], score: Callable[[Members], float], starts: Sequence[str]
) -> dict[Members, float]:
    """Every set the greedy search tried, with its score, in the order tried (sets keep the order of `bases`)."""
    tried: dict[Members, float] = {}
    order = {b: i for i, b in enumerate(bases)}
    for start in starts:
        current: Members = (start,)
        best = single[start]
        while len(current) < len(bases):
            options = [tuple(sorted((*current, b), key=order.__getitem__)) for b in bases if b not in current]
            for option in options:
                if option not in tried:
                    tried[option] = score(option)
            step = max(options, key=lambda o: tried[o])  # ties: the first in base order
            if tried[step] <= best:
                break
            current, best = step, tried[step]
    return tried


def dominated_by_estimate(
    accuracy_of: dict[Members, float],
    estimate: dict[Members, dict[int, float]],
    rungs: Sequence[Rung],
) -> dict[Members, str | None]:
    """For each set, the name of a rung or set that is as accurate and no slower by the estimate (None: time it)."""
    out: dict[Members, str | None] = {}
    for s, acc in accuracy_of.items():
        est = estimate[s]
        by = next(
            (
                r.name
                for r in sorted(rungs, key=lambda r: -r.val_accuracy)
                if r.val_accuracy >= acc and all(r.profile(b).p50_ms <= ms for b, ms in est.items())
            ),
            None,
        )
        if by is None:
            by = next(
                (
                    "+".join(t)
                    for t, other in accuracy_of.items()
                    if t != s
                    and other >= acc
                    and all(estimate[t][b] <= ms for b, ms in est.items())
                    and (other > acc or any(estimate[t][b] < ms for b, ms in est.items()))
                ),
                None,
            )
        out[s] = by
    return out


def ensemble_bases(ctx: BuildContext, rungs: list[Rung], last_exit: str, config: EnsembleConfig) -> list[Rung]:
    """The main model's INT8 last exit and each member's INT8 rung; FP32 where INT8 lost too much on val, or
    where INT8 was not built (it does not pay on this machine)."""
    by_name = {r.name: r for r in rungs}
    bases = []
    for graph in [last_exit, *ctx.inputs.members]:
        fp32 = by_name[f"{graph}.{Precision.FP32}.{Backend.ONNXRUNTIME}"]
        int8 = by_name.get(f"{graph}.{Precision.INT8}.{Backend.ONNXRUNTIME}")
        if int8 is None:
            bases.append(fp32)
            continue
        drop_pp = (fp32.val_accuracy - int8.val_accuracy) * 100
        if drop_pp > config.int8_max_drop_pp:
            ctx.log(f"{graph}: INT8 loses {drop_pp:.2f} pp on val (> {config.int8_max_drop_pp}); FP32 joins")
        bases.append(fp32 if drop_pp > config.int8_max_drop_pp else int8)
    return bases


def _name(members: Sequence[Rung]) -> str:
    precision = Precision.INT8 if all(m.precision is Precision.INT8 for m in members) else Precision.FP32
    return "ensemble." + "+".join(m.name.split(".")[0] for m in members) + f".{precision}.{Backend.ONNXRUNTIME}"


class _Logits:
    """The bases' val and test logits (from the evaluation cache) and the labels."""

    def __init__(self, ctx: BuildContext, bases: list[Rung]) -> None:
        self.val_labels, self.test_labels = ctx.inputs.split("val").labels, ctx.inputs.split("test").labels
        self.by_name = {
            r.name: engine_logits(ctx, ctx.out / r.artifact.path, r.backend, r.precision, ("val", "test"))
            for r in bases
        }

    def features(self, members: Members, split: str) -> np.ndarray:
        return member_features([self.by_name[m][split] for m in members])

    def soft_vote(self, members: Members, split: str) -> float:
        labels = self.val_labels if split == "val" else self.test_labels
        return accuracy(soft_vote([self.by_name[m][split] for m in members]), labels)


def search(ctx: BuildContext, bases: list[Rung], config: EnsembleConfig) -> tuple[_Logits, list[dict[str, Any]]]:
    """The greedy search, cached: every tried set with its LR out-of-fold val accuracy and LR test accuracy."""
    logits = _Logits(ctx, bases)
    names = [r.name for r in bases]
    key = {
        "bases": [[r.name, r.artifact.sha256] for r in bases],
        "val": ctx.inputs.split("val").fingerprint,
        "test": ctx.inputs.split("test").fingerprint,
        "seed": config.seed,
        "starts": config.starts,
        "folds": FOLDS,
        "settings": SETTINGS,
        "versions": {**ctx.versions, **stacker_versions()},
    }

    def make() -> list[dict[str, Any]]:
        from threadpoolctl import threadpool_limits

        def score(members: Members) -> float:
            oof = out_of_fold(StackerKind.LOGISTIC, logits.features(members, "val"), logits.val_labels, config.seed)
            return float((oof == logits.val_labels).mean())

        single = {r.name: r.val_accuracy for r in bases}
        starts = sorted(names, key=lambda n: -single[n])
        tried = forward_selection(names, single, score, starts if config.starts == "every" else starts[:1])
        rows = []
        for members, val_acc in tried.items():
            with threadpool_limits(1):
                lr = candidate(StackerKind.LOGISTIC, config.seed).fit(
                    logits.features(members, "val"), logits.val_labels
                )
            test_pred = lr.predict(logits.features(members, "test"))
            rows.append(
                {
                    "members": list(members),
                    "val_accuracy": val_acc,
                    "test_accuracy": float((test_pred == logits.test_labels).mean()),
                    "soft_vote_test_accuracy": logits.soft_vote(members, "test"),
                }
            )
        return rows

    return logits, ctx.cache.run("ensemble-search", key, make)


def build_ensembles(
    ctx: BuildContext, rungs: list[Rung], last_exit: str, config: EnsembleConfig, profile: ProfileConfig
) -> tuple[list[Ensemble], list[EnsembleTried]]:
    """The measured ensembles (sets that may be on the front) and the tried sets pruned before timing."""
    if not ctx.inputs.members:
        return [], []
    bases = ensemble_bases(ctx, rungs, last_exit, config)
    by_name = {r.name: r for r in rungs}
    logits, rows = search(ctx, bases, config)
    acc = {tuple(row["members"]): float(row["val_accuracy"]) for row in rows}
    estimate = {s: {b: sum(by_name[m].profile(b).p50_ms for m in s) for b in profile.batch_sizes} for s in acc}
    dominated = dominated_by_estimate(acc, estimate, rungs)
    ensembles, pruned = [], []
    for row in ctx.bar(rows, "fit and measure ensembles"):
        members = tuple(row["members"])
        name = _name([by_name[m] for m in members])
        if dominated[members] is None:
            ensembles.append(_ensemble(ctx, [by_name[m] for m in members], logits, by_name, config, profile))
            continue
        pruned.append(
            EnsembleTried(
                name=name,
                members=list(members),
                stacker=str(StackerKind.LOGISTIC),
                val_accuracy=row["val_accuracy"],
                test_accuracy=row["test_accuracy"],
                soft_vote_test_accuracy=row["soft_vote_test_accuracy"],
                p50_ms_batch1=estimate[members][min(profile.batch_sizes)],
                kept=False,
                dominated_by=_dominator_name(dominated[members], by_name),
                measured=False,
            )
        )
    return ensembles, pruned


def _dominator_name(by: str | None, rungs: dict[str, Rung]) -> str | None:
    if by is None or by in rungs:
        return by
    return _name([rungs[m] for m in by.split("+")])


def _stacker(
    ctx: BuildContext, name: str, members: list[Rung], logits: _Logits, config: EnsembleConfig
) -> tuple[Path, dict[str, Any]]:
    """Fit (LR or MLP by CV on val) and export one stacker; reused while its members and val are unchanged."""
    path, report_path = ctx.out / f"{name}.stacker.onnx", ctx.out / f"{name}.stacker.json"
    key = {
        "members": [m.artifact.sha256 for m in members],
        "val": ctx.inputs.split("val").fingerprint,
        "seed": config.seed,
        "kinds": [str(k) for k in config.stackers],
        "folds": FOLDS,
        "settings": SETTINGS,
        "versions": {**ctx.versions, **stacker_versions()},
        "report": 2,  # 2: with the out-of-fold answers' right/wrong per val image
    }

    def make() -> dict[str, Any]:
        features = logits.features(tuple(m.name for m in members), "val")
        fit = fit_stacker(
            features, logits.val_labels, config.seed, config.stackers, jobs=ctx.eval_threads
        )  # not timed: every core
        export_stacker(fit.estimator, features.shape[1], path)
        right = pack_right(fit.oof_predictions == logits.val_labels)
        report = {"kind": str(fit.kind), "cv_accuracy": fit.cv_accuracy, "oof_right": right}
        report_path.write_text(json.dumps(report, indent=1))
        return report

    return path, ctx.cache.run(f"stacker/{name}", key, make, [path, report_path])


def _ensemble(
    ctx: BuildContext,
    members: list[Rung],
    logits: _Logits,
    rungs: dict[str, Rung],
    config: EnsembleConfig,
    profile: ProfileConfig,
) -> Ensemble:
    name = _name(members)
    names = tuple(m.name for m in members)
    path, report = _stacker(ctx, name, members, logits, config)
    kind, num_classes = StackerKind(report["kind"]), len(ctx.inputs.checkpoint.class_names)
    session = StackerSession(path, None, kind, len(members) * num_classes, num_classes)
    record = Ensemble(
        name=name,
        precision=Precision.INT8 if all(m.precision is Precision.INT8 for m in members) else Precision.FP32,
        backend=Backend.ONNXRUNTIME,
        artifact=ctx.artifact(path),
        input_shape=members[0].input_shape,
        outputs=["logits"],
        profiles=[],
        macs=sum(m.macs for m in members),
        peak_memory_bytes=0,
        members=list(names),
        stacker=str(kind),  # type: ignore[arg-type]
        stacker_cv_accuracy=report["cv_accuracy"],
        fit_split="val",
        fit_fingerprint=ctx.inputs.split("val").fingerprint,
        val_accuracy=report["cv_accuracy"][str(kind)],
        val_right_by_depth=[report["oof_right"]],
        test_accuracy=accuracy(session.predict_proba(logits.features(names, "test")), logits.test_labels),
        soft_vote_val_accuracy=logits.soft_vote(names, "val"),
        soft_vote_test_accuracy=logits.soft_vote(names, "test"),
    )
    # Its timing depends on the stacker and every member file.
    files = hashlib.sha256(" ".join([record.artifact.sha256, *(m.artifact.sha256 for m in members)]).encode())
    key = {
        "files": files.hexdigest(),
        "profile": profile.key(),
        "machine": machine_key(),
        "versions": ctx.versions,
        "concurrent": concurrent_members(ctx.threads, len(members)),  # members side by side or in turn
    }

    def make() -> dict[str, Any]:
        engine, memory = measure_peak_memory(lambda: open_ensemble(ctx.out, record, rungs, num_classes, ctx.threads))
        try:
            profiles = [measure_latency(engine, b, profile).model_dump() for b in profile.batch_sizes]
        finally:
            engine.close()
        return {"profiles": profiles, "peak_memory_bytes": memory}

    numbers = ctx.cache.run(f"measure/{name}", key, make)
    record.profiles = [LatencyProfile(**p) for p in numbers["profiles"]]
    record.peak_memory_bytes = numbers["peak_memory_bytes"]
    return record
