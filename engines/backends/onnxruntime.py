"""ONNX Runtime on the CPU: FP32 and INT8 (QDQ) graphs; FP16 graphs run too, for measurement."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.base import Backend, BackendUnavailable, EngineBase, Precision, verify_artifact


def _ort():  # type: ignore[no-untyped-def]
    try:
        import onnxruntime
    except ImportError as e:
        raise BackendUnavailable(f"onnxruntime is not installed: {e}") from None
    return onnxruntime


def session_options(threads: int):  # type: ignore[no-untyped-def]
    """Fixed thread counts and denormals flushed to zero (they slow CPU kernels by orders of magnitude)."""
    ort = _ort()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.set_denormal_as_zero", "1")
    # Threads that spin after each run steal the other core from concurrent sessions (ensembles, the server).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


class OnnxRuntimeEngine(EngineBase):
    backend = Backend.ONNXRUNTIME
    concurrent = True  # InferenceSession.run is thread-safe

    def __init__(self, path: Path, precision: Precision, threads: int = 2, sha256: str | None = None) -> None:
        verify_artifact(path, sha256)
        ort = _ort()
        self.path, self.precision, self.threads = Path(path), Precision(precision), threads
        try:
            self.session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for unreadable graphs
            raise ValueError(f"onnxruntime cannot load {path}: {e}") from None
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.input_shape = tuple(int(d) for d in inp.shape[1:])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        return list(self.session.run(self.output_names, {self.input_name: np.ascontiguousarray(x, np.float32)}))

    def close(self) -> None:
        del self.session
