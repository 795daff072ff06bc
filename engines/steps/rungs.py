"""Rung and stage records: one engine made from a graph, its measured profile, memory and accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from engines.backends.tensorrt import read_sidecar
from engines.base import Backend
from engines.factory import open_engine
from engines.manifest import EngineRecord, LatencyProfile, PlanInfo, Rung, Stage, pack_right
from engines.steps.context import BuildContext, machine_key
from engines.steps.evaluate import accuracy, engine_logits
from engines.steps.graphs import EngineKind, Graph
from engines.steps.measure import ProfileConfig, profile_engine, profile_from_rounds, time_interleaved


def measured(ctx: BuildContext, g: Graph, kind: EngineKind, config: ProfileConfig) -> dict[str, Any]:
    """The engine's record fields: artifact, profiles, peak memory; timed once per file and measuring setting."""
    path = ctx.out / kind.artifact(g)
    art = ctx.artifact(path)
    name = kind.name(g.name)
    key = {
        "file": art.sha256,
        "backend": str(kind.backend),
        "precision": str(kind.precision),
        "profile": config.key(),
        "machine": machine_key(),
        "versions": ctx.versions,
    }
    numbers = ctx.cache.run(
        f"measure/{name}",
        key,
        lambda: profile_engine(lambda: open_engine(kind.backend, path, kind.precision, ctx.threads), config),
    )
    return {
        "name": name,
        "precision": kind.precision,
        "backend": kind.backend,
        "artifact": art,
        "input_shape": list(g.item_shape),
        "outputs": g.outputs,
        "profiles": numbers["profiles"],
        "macs": g.macs,
        "peak_memory_bytes": numbers["peak_memory_bytes"],
        **(plan_fields(ctx, path) if kind.backend is Backend.TENSORRT else {}),
    }


def plan_fields(ctx: BuildContext, plan: Path) -> dict[str, Any]:
    """A TensorRT rung's `max_batch` and `plan` record, from the sidecar the plan step wrote."""
    meta = read_sidecar(plan)
    profile = meta["profile"]
    info = PlanInfo(
        source=ctx.artifact(ctx.out / meta["onnx_file"]),
        tensorrt_version=meta["tensorrt_version"],
        cuda_version=meta["cuda_version"],
        gpu_name=meta["gpu_name"],
        compute_capability=meta["compute_capability"],
        min_batch=profile["min"],
        opt_batch=profile["opt"],
        max_batch=profile["max"],
        int8=meta["int8"],
    )
    return {"max_batch": info.max_batch, "plan": info}


def make_rung(ctx: BuildContext, g: Graph, kind: EngineKind, config: ProfileConfig) -> Rung:
    record = measured(ctx, g, kind, config)
    logits = engine_logits(ctx, ctx.out / kind.artifact(g), kind.backend, kind.precision, ("val", "test"))
    member = ctx.inputs.members.get(g.name) if g.kind == "member" else None
    val = ctx.inputs.split("val").labels
    return Rung(
        **record,
        kind=g.kind if g.kind in ("cut", "member") else "exit",
        exit=g.exit,
        model=member.checkpoint.model_name if member else None,
        mirror=g.mirror,
        cut=list(g.cut),
        val_accuracy=accuracy(logits["val"], val),
        test_accuracy=accuracy(logits["test"], ctx.inputs.split("test").labels),
        val_right_by_depth=[pack_right(logits["val"].argmax(axis=1) == val)],
    )


def make_stage(ctx: BuildContext, g: Graph, kind: EngineKind, config: ProfileConfig) -> Stage:
    return Stage(**measured(ctx, g, kind, config), index=g.exit)


R = TypeVar("R", bound=EngineRecord)


def steady_batch1(ctx: BuildContext, records: list[R], config: ProfileConfig, label: str) -> list[R]:
    """The records (rungs, or a cascade's stages) with their batch-1 profiles timed again, every CPU engine among
    them in each of `config.rounds` interleaved rounds (engines/steps/measure.py says why). TensorRT engines keep
    their CUDA-event profiles; the other batch sizes keep theirs. Timed once per set of files and measuring
    setting; `label` names the step."""
    cpu = [r for r in records if r.backend is not Backend.TENSORRT]
    if not cpu:
        return records
    key = {
        "files": {r.name: r.artifact.sha256 for r in cpu},
        "profile": config.key(),
        "threads": ctx.threads,
        "machine": machine_key(),
        "versions": ctx.versions,
    }

    def make() -> dict[str, Any]:
        engines = {r.name: open_engine(r.backend, ctx.out / r.artifact.path, r.precision, ctx.threads) for r in cpu}
        try:
            rounds = time_interleaved(engines, 1, config.rounds, config.round_runs, config.warmup)
        finally:
            for engine in engines.values():
                engine.close()
        return {name: profile_from_rounds(1, r).model_dump() for name, r in rounds.items()}

    batch1 = ctx.cache.run(f"measure/batch-1 interleaved/{label}", key, make)
    return [
        r.model_copy(update={"profiles": [LatencyProfile(**batch1[r.name]) if p.batch == 1 else p for p in r.profiles]})
        if r.name in batch1
        else r
        for r in records
    ]
