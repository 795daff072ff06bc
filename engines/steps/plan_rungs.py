"""TensorRT rungs (`anytime build --backend tensorrt`): FP32, FP16 and INT8 plans of every graph, measured and
evaluated like any rung, and the anytime cascade of each precision's stage plans.

Each plan is a cached step keyed by its source ONNX file, the precision, the optimisation profile and the
target (TensorRT version, GPU model, CUDA version): a plan runs only where it was built, so another GPU
or TensorRT version builds anew. INT8 on TensorRT 8.x adds the calibration data to the key. All plans of
one target share a timing cache file in `plans/`, so a rebuild skips the kernel timings already taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.backends.tensorrt import require_gpu, sidecar_path, tensorrt_version
from engines.base import Backend, BackendUnavailable, Precision
from engines.manifest import Cascade, Rung, Stage
from engines.steps.cache import digest
from engines.steps.calibrate import calibration_record, feeder_files, open_calibration_set
from engines.steps.cascades import CascadeConfig, build_cascade
from engines.steps.context import BuildContext
from engines.steps.graphs import PLAN_ENGINES, EngineKind, Graph
from engines.steps.int8_calibrator import Int8Calibration
from engines.steps.measure import ProfileConfig
from engines.steps.plans import build_plan, int8_method
from engines.steps.rungs import make_rung

PLANS_DIR = "plans"


@dataclass(frozen=True)
class PlanConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32)  # the profile: min, opt (the median), max; as the profiles measure
    workspace_bytes: int = 1 << 30
    calib_samples: int = 1000  # INT8 on TensorRT 8.x calibrates on as many calib images as ONNX Runtime's did


def choose_backend(requested: str) -> tuple[Backend, str]:
    """The backend a build targets, and why: `auto` is TensorRT when it and a CUDA device are here.

    `tensorrt` without them raises BackendUnavailable naming what is missing, before any work starts.
    """
    if requested == "auto":
        try:
            trt, device = require_gpu()
        except BackendUnavailable as e:
            return Backend.ONNXRUNTIME, f"auto: ONNX Runtime ({e})"
        return Backend.TENSORRT, f"auto: TensorRT {trt.__version__} on {device.info().gpu_name}"
    backend = Backend(requested)
    if backend is Backend.TENSORRT:
        trt, device = require_gpu()
        return backend, f"TensorRT {trt.__version__} on {device.info().gpu_name}"
    if backend is not Backend.ONNXRUNTIME:
        raise ValueError(f"a ladder is built for onnxruntime or tensorrt, not {requested}")
    return backend, "ONNX Runtime"


def plan_target() -> dict[str, str]:
    """What every plan built now is tied to (part of each plan step's key, and recorded in the ladder)."""
    trt, device = require_gpu()
    info = device.info()
    return {
        "tensorrt": str(trt.__version__),
        "gpu": info.gpu_name,
        "compute_capability": info.compute_capability,
        "cuda": info.cuda_version,
        "int8": int8_method(tensorrt_version(trt)),
    }


def timing_cache_path(ctx: BuildContext, target: dict[str, str]) -> Path:
    """One timing cache per target: TensorRT refuses a cache from another GPU or version."""
    return ctx.out / PLANS_DIR / f"timing.{digest(target)[:12]}.cache"


def source_file(g: Graph, kind: EngineKind, int8: str) -> str:
    """The ONNX file a plan is built from: the QDQ file for INT8 on TensorRT 10, else the FP32 file."""
    if kind.precision is Precision.INT8 and int8 == "qdq":
        return g.file(Precision.INT8, tensorrt=True)
    return g.file(Precision.FP32)


def _build_one(
    ctx: BuildContext, g: Graph, kind: EngineKind, config: PlanConfig, target: dict[str, str]
) -> tuple[str, dict[str, Any], Any, list[Path]]:
    source = ctx.out / source_file(g, kind, target["int8"])
    plan = ctx.out / kind.artifact(g)
    key: dict[str, Any] = {
        "graph": g.spec(),
        "source": ctx.cache.sha256(source),
        "precision": str(kind.precision),
        "batch_sizes": sorted(set(config.batch_sizes)),
        "workspace_bytes": config.workspace_bytes,
        "target": target,
    }
    calibration = None
    if kind.precision is Precision.INT8 and target["int8"] == "entropy_calibrator":
        feeders = feeder_files(ctx, g)
        key["calibration"] = {
            **calibration_record(ctx, config.calib_samples),
            "feeders": [ctx.cache.sha256(Path(p)) for p in feeders],
        }
        # Named by what it was computed from: a changed graph or data set never reads a stale cache.
        cache = ctx.out / PLANS_DIR / "calibration" / f"{g.name}.{digest(key)[:12]}.cache"
        data = open_calibration_set(ctx.data, ctx.inputs.spec.to_dict(), config.calib_samples, feeders)
        calibration = Int8Calibration(data, cache)

    def make() -> None:
        build_plan(
            source,
            plan,
            kind.precision,
            config.batch_sizes,
            config.workspace_bytes,
            timing_cache_path(ctx, target),
            calibration,
        )

    return f"plan/{kind.name(g.name)}", key, make, [plan, sidecar_path(plan)]


def build_plans(ctx: BuildContext, graphs: list[Graph], config: PlanConfig) -> dict[str, str]:
    """A plan in each precision for every graph (cached); returns the target they were built for."""
    target = plan_target()
    for g, kind in ctx.bar([(g, k) for g in graphs for k in PLAN_ENGINES], "build TensorRT plans"):
        step, key, make, files = _build_one(ctx, g, kind, config, target)
        ctx.cache.run(step, key, make, files)
    return target


def plan_rungs(
    ctx: BuildContext, answering: list[Graph], stages: list[Graph], profile: ProfileConfig, cascade: CascadeConfig
) -> tuple[list[Rung], list[Stage], list[Cascade]]:
    """Rungs of the answering graphs' plans, and one cascade of stage plans per precision."""
    pairs = [(g, k) for g in answering for k in PLAN_ENGINES]
    rungs = [make_rung(ctx, g, k, profile) for g, k in ctx.bar(pairs, "measure TensorRT rungs")]
    stage_records: list[Stage] = []
    cascades: list[Cascade] = []
    for kind in ctx.bar(PLAN_ENGINES, "measure TensorRT cascades"):
        records, chain = build_cascade(ctx, stages, kind, cascade, profile)
        stage_records += records
        cascades.append(chain)
    return rungs, stage_records, cascades
