"""What the build starts from (checkpoints, data) and what it exports: one `Graph` per network to turn into engines.

A graph is a cascade stage, a fixed exit or a residual cut of the main multi-exit model, or an ensemble
member (a single-exit checkpoint of its own, or its mirror view: the same network on the flipped image). Each
becomes one FP32 ONNX file, and from it the engines of the precisions this machine can use (`EngineKind`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.base import Backend, Precision, sha256_file
from engines.manifest import Artifact
from models.checkpoint import Checkpoint, load_checkpoint
from models.data import DataSource, PreprocessSpec, Split, open_source

KIND_ORDER = {"exit": 0, "cut": 1, "member": 2}


class BuildError(ValueError):
    """Build inputs that do not fit together (e.g. a member trained with other preprocessing)."""


@dataclass(frozen=True)
class EngineKind:
    """One engine made from a graph: run in `precision` by `backend`, from the `file` precision's ONNX."""

    precision: Precision
    backend: Backend
    file: Precision

    def name(self, graph: str) -> str:
        return f"{graph}.{self.precision}.{self.backend}"

    def artifact(self, g: Graph) -> str:
        """The engine's file in the ladder directory: the ONNX file itself, or the TensorRT plan built from it."""
        if self.backend is Backend.TENSORRT:
            return f"plans/{g.name}.{self.precision}.plan"
        return g.file(self.file)


FP32 = EngineKind(Precision.FP32, Backend.ONNXRUNTIME, Precision.FP32)
INT8 = EngineKind(Precision.INT8, Backend.ONNXRUNTIME, Precision.INT8)
BF16 = EngineKind(Precision.BF16, Backend.OPENVINO, Precision.FP32)  # OpenVINO runs the FP32 file in BF16
FP16 = EngineKind(Precision.FP16, Backend.ONNXRUNTIME, Precision.FP16)  # the GPU file, measured here honestly
# Every engine that runs on this CPU, by precision; the probe decides which of BF16/FP16 are built.
CPU_ENGINES = {k.precision: k for k in (FP32, INT8, BF16, FP16)}
# TensorRT plans (`anytime build --backend tensorrt`): FP16 by builder flag on the FP32 file; INT8 from the
# symmetric QDQ file (TensorRT 10) or the FP32 file and a calibrator (8.x): engines/steps/plans.py.
PLAN_ENGINES = (
    EngineKind(Precision.FP32, Backend.TENSORRT, Precision.FP32),
    EngineKind(Precision.FP16, Backend.TENSORRT, Precision.FP32),
    EngineKind(Precision.INT8, Backend.TENSORRT, Precision.INT8),
)


@dataclass
class Graph:
    """One exported network: a cascade stage, a fixed exit, a residual cut (answering at the last exit) or a member."""

    name: str
    kind: str  # "stage" | "exit" | "cut" | "member"
    exit: int
    cut: tuple[str, ...] = ()
    item_shape: tuple[int, ...] = ()
    outputs: list[str] = field(default_factory=lambda: ["logits"])
    macs: int = 0
    source: str = ""  # a member's checkpoint sha256 (other graphs come from the main checkpoint)
    mirror: bool = False  # a member's mirror view: the member run on the image flipped left to right

    def file(self, precision: Precision, tensorrt: bool = False) -> str:
        return f"{self.name}.{precision}{'.trt' if tensorrt else ''}.onnx"

    def spec(self) -> dict[str, Any]:
        """What the graph is, for cache keys (a member's checkpoint hash only where there is one)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "exit": self.exit,
            "cut": list(self.cut),
            "item_shape": list(self.item_shape),
            "outputs": self.outputs,
            **({"source": self.source} if self.source else {}),
            **({"mirror": True} if self.mirror else {}),
        }


@dataclass
class Member:
    """A single-exit checkpoint built beside the main model for ensembles, or its mirror view (`mirror`: the
    same checkpoint run on the image flipped left to right)."""

    path: Path
    checkpoint: Checkpoint
    artifact: Artifact
    model: Any
    mirror: bool = False


MIRROR_SUFFIX = "_mirror"  # a mirror view's graph name: the member's, then this


@dataclass
class Inputs:
    """The main checkpoint, the members and the data, loaded and checked against each other once."""

    checkpoint_path: Path
    checkpoint: Checkpoint
    artifact: Artifact
    model: Any
    source: DataSource
    members: dict[str, Member]

    @property
    def spec(self) -> PreprocessSpec:
        return self.checkpoint.preprocess

    def split(self, name: str) -> Split:
        return self.source.split(name)


def checkpoint_artifact(path: Path) -> Artifact:
    path = Path(path)
    return Artifact(path=path.name, sha256=sha256_file(path), bytes=path.stat().st_size)


def load_inputs(checkpoint: Path, data: str, members: tuple[Path, ...], mirror_views: bool = False) -> Inputs:
    """The main checkpoint, each member and, with `mirror_views`, each member's mirror view after it."""
    source = open_source(data)
    ckpt = load_checkpoint(checkpoint, source)
    inputs = Inputs(Path(checkpoint), ckpt, checkpoint_artifact(checkpoint), ckpt.build_model(), source, {})
    for p in members:
        member = _load_member(Path(p), inputs)
        inputs.members[Path(p).stem] = member
        if mirror_views:
            inputs.members[Path(p).stem + MIRROR_SUFFIX] = replace(member, mirror=True)
    return inputs


def _load_member(path: Path, inputs: Inputs) -> Member:
    """A member checkpoint: checked against the data, and fed exactly the main model's input."""
    ckpt = load_checkpoint(path, inputs.source)
    model = ckpt.build_model()
    if getattr(model, "num_stages", 1) != 1:
        raise BuildError(f"member {path} has {model.num_stages} exits; members answer with one")
    if ckpt.preprocess != inputs.spec or ckpt.class_names != inputs.checkpoint.class_names:
        raise BuildError(f"member {path} was trained with other preprocessing or classes than the main model")
    return Member(path, ckpt, checkpoint_artifact(path), model)


def plan_graphs(inputs: Inputs, cuts: list[tuple[str, ...]], base: bool = True) -> list[Graph]:
    """Every stage and exit of the main model and each member (unless not `base`), and the given cuts;
    shapes and MACs filled in."""
    import torch

    from engines.steps.modules import stage_input_shape
    from models.evaluate import count_macs

    model, shape = inputs.model, tuple(inputs.spec.input_shape)
    k_last = model.num_stages
    graphs = [Graph(f"cut{i}", "cut", k_last, cut, shape) for i, cut in enumerate(cuts, 1)]
    if base:
        graphs += [
            Graph(f"stage{k}", "stage", k, (), stage_input_shape(model, shape, k), ["features", "logits"])
            for k in range(1, k_last + 1)
        ]
        graphs += [Graph(f"exit{k}", "exit", k, (), shape) for k in range(1, k_last + 1)]
        graphs += [
            Graph(name, "member", 1, (), shape, source=m.artifact.sha256, mirror=m.mirror)
            for name, m in inputs.members.items()
        ]
    for g in graphs:
        g.macs = count_macs(module(inputs.model, g, inputs.members), torch.zeros(1, *g.item_shape))
    return graphs


def module(model: Any, g: Graph, members: dict[str, Member]) -> Any:
    """The torch module that computes graph `g` (an nn.Module)."""
    return graph_module(g, members[g.name].model if g.kind == "member" else model)


def graph_module(g: Graph, network: Any) -> Any:
    """The torch module that computes graph `g` from `network`: the main model, or a member graph's own network."""
    from engines.steps.modules import ExitGraph, MirrorGraph, StageGraph

    if g.kind == "member":
        return MirrorGraph(network) if g.mirror else network
    return StageGraph(network, g.exit) if g.kind == "stage" else ExitGraph(network, g.exit, g.cut)
