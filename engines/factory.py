"""Open an engine by backend name; optional backends are imported only here, only when asked for."""

from __future__ import annotations

from pathlib import Path

from engines.base import Backend, Engine, Precision
from engines.manifest import EngineRecord, Ensemble, Ladder


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


def open_record(directory: Path, ladder: Ladder, record: EngineRecord, threads: int = 2) -> Engine:
    """The engine of one ladder record: a rung's or stage's file, or an ensemble with its member rungs."""
    if isinstance(record, Ensemble):
        from engines.ensemble import open_ensemble

        rungs = {r.name: r for r in ladder.rungs}
        return open_ensemble(directory, record, rungs, len(ladder.class_names), threads)
    path = Path(directory) / record.artifact.path
    return open_engine(record.backend, path, record.precision, threads, record.artifact.sha256)
