"""Open an engine by backend name; optional backends are imported only here, only when asked for."""

from __future__ import annotations

from pathlib import Path

from engines.base import Backend, Engine, Precision


def open_engine(
    backend: Backend, path: Path, precision: Precision, threads: int = 2, sha256: str | None = None
) -> Engine:
    """Load `path` with `backend`; raises BackendUnavailable when that backend cannot run here."""
    backend = Backend(backend)
    if backend is Backend.ONNXRUNTIME:
        from engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, precision, threads, sha256)
    if backend is Backend.OPENVINO:
        from engines.openvino import OpenVinoEngine

        return OpenVinoEngine(path, precision, threads, sha256)
    if backend is Backend.TENSORRT:
        from engines.tensorrt import TensorRTEngine

        return TensorRTEngine(path, sha256=sha256)
    raise ValueError(f"backend {backend} has no engine file to open (the torch engine wraps a live model)")
