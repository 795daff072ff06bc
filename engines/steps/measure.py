"""Measurements for the manifest: latency percentiles, accuracy, peak memory. Methods stated in each docstring."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engines.base import Engine
from engines.manifest import LatencyProfile
from models.data import PreprocessSpec, Split


def measure_latency(engine: Engine, batch: int, runs: int = 200, warmup: int = 20) -> LatencyProfile:
    """Wall time of `engine.run` on one random batch: `warmup` untimed calls, then `runs` timed ones."""
    x = np.random.default_rng(batch).standard_normal((batch, *engine.input_shape)).astype(np.float32)  # type: ignore[attr-defined]
    for _ in range(warmup):
        engine.run(x)
    samples = np.empty(runs)
    for i in range(runs):
        start = time.perf_counter()
        engine.run(x)
        samples[i] = time.perf_counter() - start
    p50, p90, p99 = np.percentile(samples * 1e3, [50, 90, 99])
    return LatencyProfile(batch=batch, p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99), runs=runs)


def predict_logits(
    engine: Engine,
    split: Split,
    spec: PreprocessSpec,
    batch_size: int = 250,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Logits for every image of a split (in order)."""
    outs = []
    for images, _ in split.batches(batch_size):
        x = spec.normalize(images)
        outs.append(engine.infer(transform(x) if transform else x))
    return np.concatenate(outs)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())


def machine_info() -> dict[str, str]:
    """CPU model, core count and platform: recorded beside every measurement."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": str(os.cpu_count()), "platform": platform.platform()}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure_peak_memory(load: Callable[[], Engine], batch: int = 32) -> tuple[Engine, int]:
    """Peak resident-set growth (bytes) while loading an engine and running one batch.

    Resets the kernel's high-water mark (/proc/self/clear_refs) first; where that is not allowed the
    figure is the growth of the current RSS instead.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        field = "VmHWM"
    except OSError:
        field = "VmRSS"
    before = _status_kib("VmRSS")
    engine = load()
    engine.run(np.zeros((batch, *engine.input_shape), np.float32))  # type: ignore[attr-defined]
    return engine, max(0, _status_kib(field) - before) * 1024
