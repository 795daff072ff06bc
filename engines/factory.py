"""Open an engine by backend name; optional backends are imported only here, only when asked for."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engines.base import Backend, Engine, Precision
from engines.ensemble import EnsembleEngine, StackerKind, StackerSession
from engines.manifest import EngineRecord, Ensemble, Ladder, Rung


def open_engine(
    backend: Backend,
    path: Path,
    precision: Precision,
    threads: int = 2,
    sha256: str | None = None,
    source_sha256: str | None = None,
) -> Engine:
    """Load `path` with `backend`; raises BackendUnavailable when that backend cannot run here.

    `source_sha256`: for a TensorRT plan, the ONNX file it must have been built from (its sidecar says).
    """
    backend = Backend(backend)
    if backend is Backend.ONNXRUNTIME:
        from engines.backends.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, precision, threads, sha256)
    if backend is Backend.OPENVINO:
        from engines.backends.openvino import OpenVinoEngine

        return OpenVinoEngine(path, precision, threads, sha256)
    if backend is Backend.TENSORRT:
        from engines.backends.tensorrt import TensorRTEngine

        return TensorRTEngine(path, onnx_sha256=source_sha256, sha256=sha256)
    raise ValueError(f"backend {backend} has no engine file to open (the torch engine wraps a live model)")


def open_ensemble(
    directory: Path, record: Ensemble, rungs: Mapping[str, Rung], num_classes: int, threads: int
) -> EnsembleEngine:
    """Open an ensemble rung: its member rungs with the threads split between them, and its stacker. The members
    run side by side only when `threads` gives each one a thread of its own (`concurrent_members`)."""
    members = [rungs[name] for name in record.members]
    per_member = max(1, threads // len(members))
    engines = [
        open_engine(
            r.backend,
            Path(directory) / r.artifact.path,
            r.precision,
            per_member,
            r.artifact.sha256,
            r.plan.source.sha256 if r.plan is not None else None,
        )
        for r in members
    ]
    stacker = StackerSession(
        Path(directory) / record.artifact.path,
        record.artifact.sha256,
        StackerKind(record.stacker),
        len(members) * num_classes,
        num_classes,
    )
    return EnsembleEngine(engines, stacker, record.precision, concurrent_members(threads, len(members)))


def concurrent_members(threads: int, members: int) -> bool:
    """Whether an ensemble's members run side by side: only with a thread for each within `threads`. Else in turn:
    a pool's threads on one thread's budget oversubscribe the cores (engines.ensemble.EnsembleEngine)."""
    return threads >= members


def open_record(directory: Path, ladder: Ladder, record: EngineRecord, threads: int = 2) -> Engine:
    """The engine of one ladder record: a rung's or stage's file, or an ensemble with its member rungs."""
    if isinstance(record, Ensemble):
        rungs = {r.name: r for r in ladder.rungs}
        return open_ensemble(directory, record, rungs, len(ladder.class_names), threads)
    path = Path(directory) / record.artifact.path
    source = record.plan.source.sha256 if record.plan is not None else None
    return open_engine(record.backend, path, record.precision, threads, record.artifact.sha256, source)
