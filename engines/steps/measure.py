"""Latency profiles and peak memory of one engine, measured serially on a quiet machine; the stop rule stated here.

The stop rule (`ProfileConfig`): warm up, then time single calls. After a floor of `min_runs` timed runs,
and every `check_every` runs after that, the p99's 95 % percentile-bootstrap interval (`resamples`
resamples, fixed seed) is computed; timing stops as soon as both ends lie within ±`tolerance` of the p99.
It also stops at the cap of `max_runs` runs, or once timing this profile has taken `max_seconds` (never
before the floor). Each profile records the runs it took, so floor <= runs <= cap. Stable, slow profiles
(batch 32 of big engines, where most measuring time went at a fixed 200 runs) stop at the floor; noisy, fast
ones (batch 1) run on, which costs little.

A rung's and a cascade stage's batch-1 profile, the one the planner predicts from and the builder compares costs
by, is then timed again with the others of its kind (`time_interleaved`, `profile_from_rounds`): `rounds` rounds of
`round_runs` runs, engine after engine in each round, and each percentile is the median of the rounds' own. Timed
in one block (200 runs at most: 40 ms for a 0.2 ms engine), an engine that a slow spell of the shared machine fell
on kept the slow figure (MobileNetV2's mirror view INT8 once 0.272 ms, 0.184 ms side by side), and the builder
marks dominated rungs and orders member cascades by those costs. A spell of a few hundred ms falls in one round of
the engines it overlaps, and the median of the rounds leaves it out. Measured on the default ladder's 24 CPU rungs
(README, "Latency profiles"): p50s more than 25 % off relative to the other rungs' in 6.8-9.9 % of profiles timed
in one block, 0-2.6 % interleaved.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from engines.base import Engine
from engines.manifest import LatencyProfile

K = TypeVar("K")


@dataclass(frozen=True)
class ProfileConfig:
    threads: int = 1
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    min_runs: int = 50
    max_runs: int = 200
    max_seconds: float = 0.5
    tolerance: float = 0.05
    check_every: int = 25
    resamples: int = 200
    warmup: int = 10
    rounds: int = 5  # batch 1 timed again, every rung in each round (time_interleaved)
    round_runs: int = 100

    @classmethod
    def fixed(cls, runs: int, **options: Any) -> ProfileConfig:
        """Exactly `runs` timed runs (benchmarks that compare engines side by side)."""
        return cls(min_runs=runs, max_runs=runs, max_seconds=float("inf"), **options)

    def key(self) -> dict[str, Any]:
        return {**asdict(self), "batch_sizes": list(self.batch_sizes)}


def p99_stable(samples: np.ndarray, tolerance: float, resamples: int, seed: int = 0) -> bool:
    """Whether the p99's 95 % bootstrap interval lies within ±tolerance of the p99 of `samples`."""
    p99 = float(np.percentile(samples, 99))
    rng = np.random.default_rng(seed)
    boot = np.percentile(rng.choice(samples, (resamples, len(samples))), 99, axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return bool(low >= p99 * (1 - tolerance) and high <= p99 * (1 + tolerance))


def measure_latency(
    engine: Engine,
    batch: int,
    config: ProfileConfig | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LatencyProfile:
    """Wall time of `engine.run` on one random batch (a GPU engine's CUDA-event time from its `run_timed`), timed
    until the stop rule holds (see the module doc)."""
    config = config or ProfileConfig()
    x = np.random.default_rng(batch).standard_normal((batch, *engine.input_shape)).astype(np.float32)  # type: ignore[attr-defined]
    # A GPU engine times itself with CUDA events on its stream (copy in to copy out), not the host's clock.
    run_timed: Callable[[np.ndarray], tuple[list[np.ndarray], float]] | None = getattr(engine, "run_timed", None)
    for _ in range(config.warmup):
        engine.run(x)
    samples = np.empty(config.max_runs)
    started = clock()
    n = 0
    while n < config.max_runs:
        start = clock()
        if run_timed is None:
            engine.run(x)
            end = clock()
            samples[n] = end - start
        else:
            samples[n] = run_timed(x)[1] / 1e3
            end = clock()
        n += 1
        if n < config.min_runs or (n - config.min_runs) % config.check_every:
            continue
        if end - started >= config.max_seconds or p99_stable(samples[:n], config.tolerance, config.resamples):
            break
    p50, p90, p99 = np.percentile(samples[:n] * 1e3, [50, 90, 99])
    return LatencyProfile(batch=batch, p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99), runs=n)


def time_interleaved(
    engines: Mapping[K, Engine],
    batch: int,
    rounds: int,
    runs: int,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[K, list[np.ndarray]]:
    """Wall times (ms) of each engine's `run` on one random batch: `rounds` rounds of `runs` runs, engine after
    engine in each round (round robin), so that drift of a shared machine hits them alike. Per engine, one array
    per round."""
    inputs = {
        k: np.random.default_rng(batch).standard_normal((batch, *e.input_shape)).astype(np.float32)  # type: ignore[attr-defined]
        for k, e in engines.items()
    }
    for k, engine in engines.items():
        for _ in range(warmup):
            engine.run(inputs[k])
    samples: dict[K, list[np.ndarray]] = {k: [] for k in engines}
    for _ in range(rounds):
        for k, engine in engines.items():
            x, times = inputs[k], np.empty(runs)
            for i in range(runs):
                start = clock()
                engine.run(x)
                times[i] = clock() - start
            samples[k].append(times * 1e3)
    return samples


def profile_from_rounds(batch: int, rounds: list[np.ndarray]) -> LatencyProfile:
    """p50, p90 and p99: each the median of the rounds' own (a slow round is outvoted, as it would not be in the
    pooled samples' p99)."""
    p50, p90, p99 = np.median([np.percentile(r, [50, 90, 99]) for r in rounds], axis=0)
    return LatencyProfile(
        batch=batch, p50_ms=float(p50), p90_ms=float(p90), p99_ms=float(p99), runs=sum(len(r) for r in rounds)
    )


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
    batch = min(batch, engine.max_batch or batch)
    engine.run(np.zeros((batch, *engine.input_shape), np.float32))  # type: ignore[attr-defined]
    return engine, max(0, _status_kib(field) - before) * 1024


def profile_engine(load: Callable[[], Engine], config: ProfileConfig) -> dict[str, Any]:
    """Peak memory, then a latency profile per batch size: the JSON the step cache keeps for one engine."""
    engine, memory = measure_peak_memory(load)
    try:
        profiles = [measure_latency(engine, b, config).model_dump() for b in config.batch_sizes]
    finally:
        engine.close()
    return {"profiles": profiles, "peak_memory_bytes": memory}
