"""Ensemble rungs at run time: member engines run concurrently, an exported stacker (ONNX) combines them.

The stacker is fitted offline (engines/steps/stacker.py) and run here by ONNX Runtime: nothing is unpickled,
and a stacker file is refused unless its sha256 matches the manifest and its graph is a classifier of the
expected form (inputs, outputs, operator types).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engines.base import ArtifactError, Backend, Engine, EngineBase, Precision, softmax, verify_artifact
from models.compat import StrEnum

STACKER_INPUT = "member_probabilities"
STACKER_OUTPUTS = ("label", "probabilities")


class StackerKind(StrEnum):
    LOGISTIC = "logistic_regression"
    MLP = "mlp"


# Exactly the operators skl2onnx emits for each kind (no ZipMap); a graph with any other (a tree ensemble, a
# network, a stacker of the other kind) is not the stacker the manifest describes.
STACKER_OPS = {
    StackerKind.LOGISTIC: frozenset({"LinearClassifier", "Normalizer"}),
    StackerKind.MLP: frozenset(
        {"MatMul", "Add", "Relu", "Softmax", "ArgMax", "ArrayFeatureExtractor", "Cast", "Identity", "Reshape"}
    ),
}


class StackerError(ArtifactError):
    """A stacker file that is not the classifier graph the manifest describes."""


def member_features(member_logits: list[np.ndarray]) -> np.ndarray:
    """The stacker's input: each member's softmax probabilities, side by side in member order (float32)."""
    return np.concatenate([softmax(np.asarray(z, np.float32)) for z in member_logits], axis=1).astype(np.float32)


def soft_vote(member_logits: list[np.ndarray]) -> np.ndarray:
    """The simple baseline: the mean of the members' probabilities."""
    return np.mean([softmax(np.asarray(z, np.float64)) for z in member_logits], axis=0)


def check_stacker_graph(path: Path, kind: StackerKind, n_features: int, num_classes: int) -> None:
    """Refuse a graph that is not a `kind` stacker over `n_features` probabilities giving `num_classes`."""
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as e:  # onnx raises DecodeError and friends for files that are not ONNX protobufs
        raise StackerError(f"{path} is not an ONNX stacker: {type(e).__name__}") from None
    graph = model.graph
    inputs = [(i.name, [d.dim_value or None for d in i.type.tensor_type.shape.dim]) for i in graph.input]
    if inputs != [(STACKER_INPUT, [None, n_features])]:
        raise StackerError(f"{path}: stacker inputs {inputs}, expected [({STACKER_INPUT!r}, [None, {n_features}])]")
    outputs = {o.name: o.type.tensor_type for o in graph.output}
    if tuple(outputs) != STACKER_OUTPUTS:
        raise StackerError(f"{path}: stacker outputs {list(outputs)}, expected {list(STACKER_OUTPUTS)}")
    probs = outputs["probabilities"]
    if probs.elem_type != onnx.TensorProto.FLOAT or [d.dim_value for d in probs.shape.dim][1:] != [num_classes]:
        raise StackerError(f"{path}: stacker probabilities are not float32 [N, {num_classes}]")
    unexpected = sorted({n.op_type for n in graph.node} - STACKER_OPS[kind])
    if unexpected:
        raise StackerError(f"{path}: operators {unexpected} have no place in a {kind} stacker; refused")


class StackerSession:
    """The stacker, verified (sha256, graph form) and opened in ONNX Runtime on one thread."""

    def __init__(self, path: Path, sha256: str | None, kind: StackerKind, n_features: int, num_classes: int) -> None:
        from engines.backends.onnxruntime import _ort, session_options

        verify_artifact(path, sha256)
        check_stacker_graph(path, StackerKind(kind), n_features, num_classes)
        self.path = Path(path)
        self.session = _ort().InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        (probs,) = self.session.run(["probabilities"], {STACKER_INPUT: np.ascontiguousarray(features, np.float32)})
        return np.asarray(probs)


class EnsembleEngine(EngineBase):
    """The members, then the stacker; answers log-probabilities.

    With `concurrent`, the members run side by side in a thread pool (ONNX Runtime releases the GIL); without it,
    one after another in the caller's thread. Side by side pays only where every member has a thread of its own
    within the ensemble's thread budget (engines.factory.concurrent_members). With one thread for a three-member
    INT8 ensemble on 2 vCPUs (2026-11-25, batch 1): in one process, the same p50 in turn as side by side and a
    shorter tail (p99 0.38 vs 0.48 ms; with one busy core beside, p50 0.34 vs 0.39 ms); through the server at
    concurrency 1 (bench.loose), client p50 0.795 vs 0.903 ms and p99 1.19 vs 1.40 ms. The cost: at batch 32 on an
    idle machine, in turn is slower (build table p50 7.5 vs 5.4 ms), the pool having borrowed an idle core beyond
    the budget.

    The service applies softmax to the last output, which recovers the stacker's probabilities exactly.
    """

    backend = Backend.ONNXRUNTIME

    def __init__(
        self, members: list[Engine], stacker: StackerSession, precision: Precision, concurrent: bool = True
    ) -> None:
        if len(members) < 2:
            raise ValueError("an ensemble needs at least two members")
        self.members, self.stacker, self.precision = members, stacker, Precision(precision)
        self.path = stacker.path
        self.input_name = members[0].input_name
        self.input_shape = tuple(getattr(members[0], "input_shape", ()))
        self.output_names = ["logits"]
        self._pool = ThreadPoolExecutor(len(members), thread_name_prefix="anytime-ensemble") if concurrent else None

    def member_logits(self, x: np.ndarray) -> list[np.ndarray]:
        if self._pool is None:
            return [m.infer(x) for m in self.members]
        futures = [self._pool.submit(m.infer, x) for m in self.members]
        return [f.result() for f in futures]

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        probs = self.stacker.predict_proba(member_features(self.member_logits(x)))
        return [np.log(np.clip(probs, 1e-12, None)).astype(np.float32)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for m in self.members:
            m.close()
