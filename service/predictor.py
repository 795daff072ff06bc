"""Latency prediction: the builder's profiles are the prior; observed service times take over online."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from engines.manifest import EngineRecord

MIN_OBSERVATIONS = 20  # below this many observations of (engine, batch), trust the builder's profile


class LatencyPredictor:
    """Predicted p99 service time (ms) per engine and batch size.

    Prior: the manifest's p99 at the batch size, linearly interpolated between measured batch sizes.
    Online: a streaming p99 over the last `window` observed service times of that engine and batch size,
    used once it has MIN_OBSERVATIONS samples.
    """

    def __init__(self, records: list[EngineRecord], window: int = 200) -> None:
        self._prior = {r.name: sorted((p.batch, p.p99_ms) for p in r.profiles) for r in records}
        self._window = window
        self._observed: dict[tuple[str, int], deque[float]] = {}
        self._count: dict[tuple[str, int], int] = {}
        self._p99: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()

    def prior(self, engine: str, batch: int) -> float:
        points = self._prior[engine]
        xs, ys = [b for b, _ in points], [ms for _, ms in points]
        if batch >= xs[-1]:
            return ys[-1] * batch / xs[-1]  # beyond the largest profile: linear in batch size
        return float(np.interp(batch, xs, ys))

    def predict(self, engine: str, batch: int = 1) -> float:
        p99 = self._p99.get((engine, batch))
        return p99 if p99 is not None else self.prior(engine, batch)

    def observe(self, engine: str, batch: int, ms: float) -> float:
        """Record one service time; returns the prediction error (observed - predicted) in ms."""
        error = ms - self.predict(engine, batch)
        key = (engine, batch)
        with self._lock:
            samples = self._observed.setdefault(key, deque(maxlen=self._window))
            samples.append(ms)
            count = self._count[key] = self._count.get(key, 0) + 1
            # Recomputing on every 10th sample keeps observe() cheap on the hot path.
            if count >= MIN_OBSERVATIONS and count % 10 == 0:
                self._p99[key] = float(np.percentile(samples, 99))
        return error
