"""ONNX export: one graph per cascade stage, per fixed exit and per residual cut, each checked against torch."""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from engines.backends.onnxruntime import OnnxRuntimeEngine
from engines.base import Precision
from engines.steps.context import BuildContext
from engines.steps.graphs import Graph
from engines.steps.modules import ExitGraph, StageGraph
from engines.steps.parallel import run_steps

EXPORT_TOLERANCE = 1e-4  # max abs logit difference, FP32 ONNX Runtime vs torch
OPSET = 18
EXPORT_FORMAT = 2  # part of every export's cache key; 2: node debug metadata stripped


class ExportError(RuntimeError):
    """An exported graph that does not compute what the torch model computes."""


def export_graph(
    module: nn.Module,
    item_shape: tuple[int, ...],
    path: Path,
    output_names: list[str],
    check_inputs: np.ndarray | None = None,
) -> Path:
    """Export with the dynamo exporter (folds batch norm), dynamic batch axis, then check against torch."""
    module = module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.randn(2, *item_shape)
    batch = torch.export.Dim("batch", min=1, max=4096)
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            input_names=["input"],
            output_names=output_names,
            dynamic_shapes=({0: batch},),
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise ExportError(f"torch.onnx.export returned no program for {path}")
    strip_node_metadata(program.model)
    program.save(str(path))
    onnx.checker.check_model(str(path))
    check_export(module, path, item_shape, check_inputs)
    return path


def strip_node_metadata(model: Any) -> None:
    """Drop the exporter's per-node debug tags (module path, class hierarchy, stack trace, rewrite rules).

    `model` is the exported program's onnx_ir model. The tags cost about 600 bytes a node, a fifth to a
    quarter of a small INT8 file, and no engine reads them.
    """
    for node in model.graph.all_nodes():
        node.metadata_props.clear()


def check_export(module: nn.Module, path: Path, item_shape: tuple[int, ...], inputs: np.ndarray | None = None) -> float:
    """Max abs output difference between FP32 ONNX Runtime and torch; raise ExportError above tolerance."""
    rng = np.random.default_rng(0)
    x = inputs if inputs is not None else rng.standard_normal((8, *item_shape)).astype(np.float32)
    with torch.inference_mode():
        ref = module(torch.from_numpy(x))
    refs = [t.numpy() for t in (ref if isinstance(ref, tuple) else (ref,))]
    engine = OnnxRuntimeEngine(path, Precision.FP32, threads=1)
    outs = engine.run(x)
    engine.close()
    worst = max(float(np.abs(a - b).max()) for a, b in zip(outs, refs, strict=True))
    if worst > EXPORT_TOLERANCE:
        raise ExportError(f"{path}: FP32 ONNX differs from torch by {worst:.2e} (tolerance {EXPORT_TOLERANCE:.0e})")
    return worst


class _quiet_exporter:
    """The dynamo exporter logs every pass at INFO; keep build output readable."""

    def __enter__(self) -> None:
        self._levels = {n: logging.getLogger(n).level for n in ("torch.onnx", "onnxscript", "torch.export")}
        for name in self._levels:
            logging.getLogger(name).setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


@dataclass(frozen=True)
class ExportJob:
    """One graph to export: from `checkpoint` (the member's own for a member graph) to `path`."""

    checkpoint: str
    graph: Graph
    path: str


@functools.cache
def _model(checkpoint: str) -> Any:
    from models.checkpoint import load_checkpoint

    return load_checkpoint(Path(checkpoint)).build_model()  # the parent process checked it against the data


def run_export_job(job: ExportJob) -> None:
    model = _model(job.checkpoint)
    g = job.graph
    module = (
        model
        if g.kind == "member"
        else StageGraph(model, g.exit)
        if g.kind == "stage"
        else ExitGraph(model, g.exit, g.cut)
    )
    export_graph(module, g.item_shape, Path(job.path), g.outputs)


def export_key(ctx: BuildContext, g: Graph) -> dict[str, Any]:
    """A member graph depends on its own checkpoint only, so retraining the main model keeps it."""
    return {
        "graph": g.spec(),
        "checkpoint": g.source or ctx.inputs.artifact.sha256,
        "format": EXPORT_FORMAT,
        "opset": OPSET,
        "versions": {k: ctx.versions[k] for k in ("torch", "onnx", "onnxruntime")},
    }


def export_graphs(ctx: BuildContext, graphs: list[Graph]) -> None:
    """Each graph's FP32 ONNX file, exported in `ctx.workers` processes; unchanged graphs are skipped."""
    jobs = []
    for g in graphs:
        path = ctx.out / g.file(Precision.FP32)
        source = ctx.inputs.members[g.name].path if g.kind == "member" else ctx.inputs.checkpoint_path
        jobs.append((f"export/{g.name}", export_key(ctx, g), ExportJob(str(Path(source).resolve()), g, str(path))))
    run_steps(ctx, run_export_job, jobs, lambda job: [Path(job.path)], "export ONNX")


def fp16_file(ctx: BuildContext, g: Graph) -> Path:
    """The FP16 ONNX file (for GPUs; measured on this CPU only when asked or probed), from the FP32 one."""
    fp32, fp16 = ctx.out / g.file(Precision.FP32), ctx.out / g.file(Precision.FP16)
    key = {"source": ctx.cache.sha256(fp32), "converter": _converter_version()}

    def make() -> None:
        convert_fp16(fp32, fp16)

    ctx.cache.run(f"fp16/{g.name}", key, make, [fp16])
    return fp16


def convert_fp16(fp32: Path, fp16: Path) -> Path:
    """FP16 weights and arithmetic, float32 inputs and outputs (the engine interface stays float32)."""
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per weight truncated to FP16's range
        half = float16.convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True)
    onnx.save(half, str(fp16))
    return fp16


def _converter_version() -> str:
    from importlib.metadata import version

    return version("onnxconverter-common")
