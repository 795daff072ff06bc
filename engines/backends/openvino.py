"""OpenVINO on the CPU: the half-precision rung here is BF16 (the CPU has no FP16 arithmetic)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from engines.base import Backend, BackendUnavailable, EngineBase, Precision, verify_artifact

# OpenVINO picks BF16 by itself on CPUs that have it, so FP32 must be asked for explicitly.
_PRECISION_HINT = {Precision.FP32: "f32", Precision.BF16: "bf16", Precision.INT8: "f32"}


class OpenVinoEngine(EngineBase):
    backend = Backend.OPENVINO

    def __init__(self, path: Path, precision: Precision, threads: int = 2, sha256: str | None = None) -> None:
        verify_artifact(path, sha256)
        try:
            import openvino as ov
        except ImportError as e:
            raise BackendUnavailable(f"openvino is not installed: {e}") from None
        precision = Precision(precision)
        if precision not in _PRECISION_HINT:
            raise ValueError(f"openvino engines here run {', '.join(_PRECISION_HINT)}, not {precision}")
        self.path, self.precision, self.threads = Path(path), precision, threads
        core = ov.Core()
        config = {
            "INFERENCE_PRECISION_HINT": _PRECISION_HINT[precision],
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
        }
        try:
            self.compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
        except Exception as e:  # openvino raises RuntimeError subclasses of its own
            raise ValueError(f"openvino cannot load {path}: {e}") from None
        inp = self.compiled.inputs[0]
        self.input_name = inp.get_any_name()
        self.input_shape = tuple(int(d.get_length()) for d in inp.get_partial_shape()[1:])
        self.output_names = [o.get_any_name() for o in self.compiled.outputs]
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()  # one infer request; callers on other threads wait their turn

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        with self._lock:
            result = self._request.infer({0: np.ascontiguousarray(x, np.float32)})
            return [np.array(result[out], np.float32) for out in self.compiled.outputs]

    def close(self) -> None:
        del self._request, self.compiled
