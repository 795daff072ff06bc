"""The anytime cascade of one precision: its stage engines measured, entropy thresholds fitted on val."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engines.manifest import Cascade, Stage, pack_right
from engines.steps.context import BuildContext
from engines.steps.evaluate import accuracy, chain_logits
from engines.steps.graphs import EngineKind, Graph
from engines.steps.measure import ProfileConfig
from engines.steps.rungs import make_stage, steady_batch1
from engines.steps.thresholds import CascadeFit, fit_thresholds, simulate


@dataclass(frozen=True)
class CascadeConfig:
    accuracy_bound_pp: float = 0.5  # the cascade may lose this much val accuracy against the last exit


def build_cascade(
    ctx: BuildContext, stages: list[Graph], kind: EngineKind, config: CascadeConfig, profile: ProfileConfig
) -> tuple[list[Stage], Cascade]:
    records = [make_stage(ctx, g, kind, profile) for g in stages]
    records = steady_batch1(ctx, records, profile, f"stages.{kind.precision}.{kind.backend}")
    chain = [(ctx.out / kind.artifact(g), kind.backend, kind.precision) for g in stages]
    val, test = ctx.inputs.split("val"), ctx.inputs.split("test")
    val_logits, test_logits = chain_logits(ctx, chain, "val"), chain_logits(ctx, chain, "test")
    stage_ms = [s.profile(1).p50_ms for s in records]
    key = {
        "val_logits": hashlib.sha256(b"".join(np.ascontiguousarray(lg).tobytes() for lg in val_logits)).hexdigest(),
        "val": val.fingerprint,
        "stage_ms": stage_ms,
        "bound_pp": config.accuracy_bound_pp,
    }

    def fit_on_val() -> dict[str, Any]:  # a grid search of seconds, skipped when nothing changed
        return asdict(fit_thresholds(val_logits, val.labels, stage_ms, config.accuracy_bound_pp))

    fit = CascadeFit(**ctx.cache.run(f"thresholds/{kind.precision}.{kind.backend}", key, fit_on_val))
    _, preds = simulate(test_logits, fit.thresholds)
    right = [simulate(val_logits[:j], fit.thresholds[: j - 1])[1] == val.labels for j in range(1, len(val_logits) + 1)]
    cascade = Cascade(
        name=f"cascade.{kind.precision}.{kind.backend}",
        precision=kind.precision,
        backend=kind.backend,
        stages=[r.name for r in records],
        thresholds=fit.thresholds,
        accuracy_bound_pp=config.accuracy_bound_pp,
        expected_exit_share=fit.exit_share,
        expected_mean_ms=fit.mean_cost_ms,
        val_accuracy=fit.accuracy,
        test_accuracy=float((preds == test.labels).mean()),
        test_last_exit_accuracy=accuracy(test_logits[-1], test.labels),
        val_accuracy_by_depth=[float(r.mean()) for r in right],
        val_right_by_depth=[pack_right(r) for r in right],
    )
    return records, cascade
