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
from torch.overrides import TorchFunctionMode

from engines.backends.onnxruntime import OnnxRuntimeEngine
from engines.base import Precision
from engines.steps.context import BuildContext
from engines.steps.graphs import Graph, graph_module
from engines.steps.parallel import run_steps

EXPORT_TOLERANCE = 1e-4  # max abs logit difference, FP32 ONNX Runtime vs torch
OPSET = 18
EXPORT_FORMAT = 3  # part of every export's cache key; 2: node debug metadata stripped; 3: TorchScript exporter first


class ExportError(RuntimeError):
    """An exported graph that does not compute what the torch model computes."""


def export_graph(
    module: nn.Module,
    item_shape: tuple[int, ...],
    path: Path,
    output_names: list[str],
    check_inputs: np.ndarray | None = None,
) -> Path:
    """Export with a dynamic batch axis (batch norm folded into the convolutions it follows), then check
    against torch.

    The TorchScript exporter where it can: on our 2-vCPU machine it took 0.28 s for exit 3 and 0.09 s for the
    DenseNet against the dynamo exporter's 2.3 and 3.1 s, for graphs of the same operators (Conv, Relu, Add,
    Gemm; a Flatten where dynamo writes a Reshape), and the default ladder's exports went from 23 to 8 s. The
    dynamo exporter takes the graphs that pool adaptively to a size that does not divide the input's (the
    ResNet's 4x4 exit heads on 7x7 features, the VGG's head), which the TorchScript one refuses.
    """
    module = module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.randn(2, *item_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice, dynamo's per-pass notes
        exporter = _dynamo_export if _uneven_adaptive_pool(module, example) else _torchscript_export
        exporter(module, example, output_names, path)
    onnx.checker.check_model(str(path))
    check_export(module, path, item_shape, check_inputs)
    return path


_ADAPTIVE_POOLS = (
    nn.functional.adaptive_avg_pool2d,
    nn.functional.adaptive_max_pool2d,
    nn.functional.adaptive_max_pool2d_with_indices,
)


class _AdaptivePools(TorchFunctionMode):
    """Notes whether a forward pass pools adaptively (average or max) to a size that does not divide its input's."""

    def __init__(self) -> None:
        super().__init__()
        self.uneven = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _ADAPTIVE_POOLS:
            pooled = out[0] if isinstance(out, tuple) else out  # max pooling may return its indices too
            self.uneven |= any(i % o for i, o in zip(args[0].shape[-2:], pooled.shape[-2:], strict=True))
        return out


def _uneven_adaptive_pool(module: nn.Module, example: torch.Tensor) -> bool:
    """The TorchScript exporter refuses such a pool (and prints the whole graph to stderr as it does)."""
    pools = _AdaptivePools()
    with torch.no_grad(), pools:
        module(example)
    return pools.uneven


def _torchscript_export(module: nn.Module, example: torch.Tensor, output_names: list[str], path: Path) -> None:
    """Writes no per-node debug tags, so the file is written as exported."""
    with torch.no_grad():
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            input_names=["input"],
            output_names=output_names,
            dynamic_axes={name: {0: "batch"} for name in ["input", *output_names]},
            opset_version=OPSET,
            do_constant_folding=True,
        )


def _dynamo_export(module: nn.Module, example: torch.Tensor, output_names: list[str], path: Path) -> None:
    with _quiet_exporter():
        program = torch.onnx.export(
            module,
            (example,),
            dynamo=True,
            input_names=["input"],
            output_names=output_names,
            dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},),
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise ExportError(f"torch.onnx.export returned no program for {path}")
    strip_node_metadata(program.model)
    program.save(str(path))


def strip_node_metadata(model: Any) -> None:
    """Drop the dynamo exporter's per-node debug tags (module path, class hierarchy, stack trace, rewrite rules).

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
    g = job.graph
    export_graph(graph_module(g, _model(job.checkpoint)), g.item_shape, Path(job.path), g.outputs)


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
