"""INT8 post-training quantization of every graph: the calibration method, then one CPU and one TensorRT QDQ file each.

The method is chosen once, on the last exit (every method quantizes it; the best val accuracy wins unless
one is named), and then used for every graph. Quantizations run in `ctx.workers` processes; each is keyed
by its FP32 source file, the method and the calibration data, so unchanged graphs are skipped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.data import CalibrationSet
from calibration.quantize import CalibrationMethod, int8_saturates, quantize_int8
from engines.base import Backend, Precision
from engines.manifest import Calibration
from engines.steps.context import BuildContext
from engines.steps.evaluate import accuracy, engine_logits
from engines.steps.graphs import Graph
from engines.steps.parallel import run_steps
from models.data import PreprocessSpec, open_source


@dataclass(frozen=True)
class CalibrationConfig:
    samples: int = 1000
    method: CalibrationMethod | None = None  # None: the method with the best val accuracy on the last exit


@dataclass(frozen=True)
class QuantJob:
    fp32: str
    cpu: str
    trt: str | None  # None: no TensorRT form (method trials)
    data: str
    spec: dict[str, Any]
    samples: int
    feeders: tuple[str, ...]  # FP32 stage files whose chained output is this graph's input (cascade stages)
    method: str
    ranges: str  # ONNX Runtime's calibration cache (the tensor ranges)
    reduce_range: bool  # 7-bit weights in the CPU form: this CPU's 8-bit kernels saturate


@functools.cache
def _calib_split(data: str) -> Any:
    return open_source(data).split("calib")


def open_calibration_set(data: str, spec: dict[str, Any], samples: int, feeders: tuple[str, ...]) -> CalibrationSet:
    """The calib split's first `samples` images as a graph's input: through the FP32 `feeders` for a later stage."""
    from engines.backends.onnxruntime import OnnxRuntimeEngine

    transform = None
    if feeders:
        engines = [OnnxRuntimeEngine(Path(p), Precision.FP32, threads=1) for p in feeders]

        def transform(x: Any) -> Any:
            for engine in engines:
                x = engine.run(x)[0]
            return x

    return CalibrationSet(_calib_split(data), PreprocessSpec.from_dict(spec), samples, transform=transform)


def feeder_files(ctx: BuildContext, g: Graph) -> tuple[str, ...]:
    """The FP32 stage files whose chained output is `g`'s input (cascade stages after the first)."""
    return tuple(str(ctx.out / f"stage{s}.fp32.onnx") for s in range(1, g.exit)) if g.kind == "stage" else ()


def calibration_record(ctx: BuildContext, samples: int) -> dict[str, object]:
    split = ctx.inputs.split("calib")
    return {"split": split.name, "fingerprint": split.head(samples).fingerprint, "samples": samples}


def run_quant_job(job: QuantJob) -> None:
    calib = open_calibration_set(job.data, job.spec, job.samples, job.feeders)
    ranges = Path(job.ranges)
    ranges.parent.mkdir(exist_ok=True)
    ranges.unlink(missing_ok=True)  # ranges are recomputed whenever the source graph changed
    quantize_int8(
        Path(job.fp32),
        Path(job.cpu),
        Path(job.trt) if job.trt else None,
        calib,
        CalibrationMethod(job.method),
        ranges,
        job.reduce_range,
    )


def _job(ctx: BuildContext, g: Graph, method: str, config: CalibrationConfig, cpu: Path, trt: Path | None) -> QuantJob:
    feeders = feeder_files(ctx, g)
    return QuantJob(
        fp32=str(ctx.out / g.file(Precision.FP32)),
        cpu=str(cpu),
        trt=str(trt) if trt else None,
        data=ctx.data,
        spec=ctx.inputs.spec.to_dict(),
        samples=config.samples,
        feeders=feeders,
        method=method,
        ranges=str(ctx.out / "calibration" / f"{g.name}.{method}.json"),
        reduce_range=int8_saturates(),
    )


def _key(ctx: BuildContext, job: QuantJob, g: Graph) -> dict[str, Any]:
    return {
        "graph": g.spec(),
        "source": ctx.cache.sha256(Path(job.fp32)),
        "feeders": [ctx.cache.sha256(Path(p)) for p in job.feeders],
        "method": job.method,
        "reduce_range": job.reduce_range,
        "calib": calibration_record(ctx, job.samples),
        "tensorrt": job.trt is not None,
        "versions": {k: ctx.versions[k] for k in ("onnx", "onnxruntime")},
    }


def _files(job: QuantJob) -> list[Path]:
    return [Path(job.cpu), *([Path(job.trt)] if job.trt else [])]


def _quantize(ctx: BuildContext, jobs: list[tuple[str, Graph, QuantJob]], desc: str) -> None:
    run_steps(ctx, run_quant_job, [(step, _key(ctx, job, g), job) for step, g, job in jobs], _files, desc)


def choose_method(ctx: BuildContext, last: Graph, config: CalibrationConfig) -> Calibration:
    """Quantize the last exit with every method (or the named one); keep the one best on val."""
    methods = [config.method] if config.method else list(CalibrationMethod)
    trials = {str(m): ctx.out / "calibration" / f"{last.name}.{m}.int8.onnx" for m in methods}
    _quantize(
        ctx,
        [(f"calibrate/{last.name}/{m}", last, _job(ctx, last, m, config, path, None)) for m, path in trials.items()],
        "calibration methods",
    )
    val = ctx.inputs.split("val")
    by_method = {
        m: accuracy(engine_logits(ctx, path, Backend.ONNXRUNTIME, Precision.INT8, ("val",))["val"], val.labels)
        for m, path in trials.items()
    }
    best = max(by_method, key=lambda m: by_method[m])
    return Calibration(
        method=best,
        chosen_by="named" if config.method else "val_accuracy",
        samples=config.samples,
        split="calib",
        fingerprint=str(calibration_record(ctx, config.samples)["fingerprint"]),
        val_accuracy_by_method=by_method,
    )


def quantize_graphs(ctx: BuildContext, graphs: list[Graph], method: str, config: CalibrationConfig) -> None:
    """Every graph's INT8 files: the CPU form (unsigned activations) and the TensorRT form (symmetric)."""
    jobs = [
        (
            f"int8/{g.name}",
            g,
            _job(ctx, g, method, config, ctx.out / g.file(Precision.INT8), ctx.out / g.file(Precision.INT8, True)),
        )
        for g in graphs
    ]
    _quantize(ctx, jobs, "quantize INT8")
