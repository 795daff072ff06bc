"""Latency prediction: the builder's profiles are the prior; observed service times take over online."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from engines.manifest import EngineRecord

MIN_OBSERVATIONS = 20  # below this many observations of (engine, batch), trust the builder's profile
HORIZON_S = 10.0  # observations older than this are forgotten: a burst's slow runs must not outlive it
IDLE_S = 0.5  # the span over which forget_if_starved weighs runs against refusals
STARVED = 20  # ... and drops the observations when the engines ran less than once per this many refusals
STEADY = 0.02  # an estimate recomputed within 2 % of the one it replaces keeps the old value (see _moved)


class LatencyPredictor:
    """Predicted p99 service time (ms) per engine and batch size.

    Prior: the manifest's p99 at the batch size, linearly interpolated between measured batch sizes.
    Online: the p90 of the last `window` observed service times of that engine and batch size within
    HORIZON_S, once it has MIN_OBSERVATIONS such samples (the prior again when it has not); the p99
    is that p90 times the profile's own p99/p90 ratio. An observed p99 follows the rare run that waited
    milliseconds for the GIL or a core; plans built on it refused work, which kept the server busy refusing,
    which made more runs wait. The p90 moves with the machine's speed and steady contention, not with its
    hiccups (the median alone let too much through under contention: answers came late). A recomputed estimate
    within STEADY (2 %) of the one it replaces keeps the old value: so the predictions, and what the planner works
    out from them (`version`), change some 50 times in 3,000 plans under load instead of every few requests
    (`python -m bench.planner`).

    Pooled: an (engine, batch) without enough samples of its own is scaled by the machine's slowdown,
    the summed observed time over the summed profiled p90 of every recent run of every engine (never below 1:
    the profile was taken on an idle machine). Contention slows every engine, and a request that plans a rung
    the server has not run lately must not be planned on the idle machine's numbers. Measured with 8
    closed-loop clients on 2 cores (400 mixed-deadline requests, 4-6 runs each): answers ready only after
    their deadline fell from 23-61 to 11-27 while on-time answers stayed level (216-245, 233-242 before). A p90
    of per-run ratios instead cut late answers to 3-11 but served 12 % fewer: a 0.07 ms engine's ratio is
    mostly a stall of fixed length, and multiplying a 1 ms engine by it overstates what that engine will take.

    Observations come only from admitted requests, so an estimate that makes every request infeasible could
    never be corrected by a new one. Measured on 2026-11-26, Poisson 800 req/s with 1 ms deadlines: slow runs
    raised exit 1's predicted p99 from 0.13 to 0.41 ms, and the server refused every request for the rest of
    the run (it would have for 10 s) while its cores idled. A trickle of admitted requests does not break such a
    lock: in a sweep the same evening, at 400 and 600 req/s, runs refused 95-100 % of the requests for about 1 s
    while 0-5 were admitted each 250 ms, on cores that the refusals left to cool, so those ran slow and kept the
    estimates up. So before the planner refuses a request it calls `forget_if_starved`: when, over the last
    IDLE_S, the engines ran less than once per STARVED requests refused on these estimates (not at all, for a
    first refusal) and no job is in flight, every observation is dropped and the request is planned again on the
    profiles. A quiet spell alone drops nothing: the next request that fits is planned on the estimates of the
    load before it; nor does a share of refusals under load, where the engines keep running.
    """

    def __init__(self, records: list[EngineRecord], window: int = 200) -> None:
        self._prior = {r.name: sorted((p.batch, p.p99_ms) for p in r.profiles) for r in records}
        self._prior_p50 = {r.name: sorted((p.batch, p.p50_ms) for p in r.profiles) for r in records}
        self._prior_p90 = {r.name: sorted((p.batch, p.p90_ms) for p in r.profiles) for r in records}
        self._window = window
        self._observed: dict[tuple[str, int], deque[tuple[float, float]]] = {}  # (when, ms)
        self._count: dict[tuple[str, int], int] = {}
        self._p90: dict[tuple[str, int], tuple[float, float]] = {}  # (when computed, p90): one read, one write
        self._pooled: deque[tuple[float, float, float]] = deque(maxlen=window)  # (when, observed, profiled p90)
        self._slowdown: tuple[float, float] | None = None  # (when computed, factor)
        self._pooled_count = 0
        self._refusals: deque[float] = deque(maxlen=window * STARVED)  # when requests were refused on them, last IDLE_S
        self._lock = threading.Lock()
        self._tables = {"p50": self._prior_p50, "p90": self._prior_p90, "p99": self._prior}
        self._interpolated: dict[tuple[str, str, int], float] = {}
        self._version = 0  # bumped whenever a prediction may have changed (see `version`)
        self._stale_at = float("inf")  # when the next estimate goes stale (HORIZON_S after it was computed)

    def prior(self, engine: str, batch: int, percentile: str = "p99") -> float:
        """The builder's profile at `batch` (p50, p90 or p99), interpolated; worked out once per key (np.interp
        took most of a plan's time: auto weighs every option)."""
        key = (percentile, engine, batch)
        value = self._interpolated.get(key)
        if value is None:
            points = self._tables[percentile][engine]
            xs, ys = [b for b, _ in points], [ms for _, ms in points]
            if batch >= xs[-1]:
                value = ys[-1] * batch / xs[-1]  # beyond the largest profile: linear in batch size
            else:
                value = float(np.interp(batch, xs, ys))
            self._interpolated[key] = value
        return value

    def predict(self, engine: str, batch: int = 1) -> float:
        key, now = (engine, batch), time.monotonic()
        observed = self._p90.get(key)
        if observed is None or now - observed[0] > HORIZON_S:
            slowdown = self._slowdown
            if slowdown is not None and now - slowdown[0] <= HORIZON_S:
                return self.prior(engine, batch) * slowdown[1]
            return self.prior(engine, batch)
        tail = self.prior(engine, batch) / max(self.prior(engine, batch, "p90"), 1e-6)
        return observed[1] * max(tail, 1.0)

    @property
    def version(self) -> int:
        """A number that changes whenever any prediction may have: a new estimate, dropped ones, or one gone stale
        (older than HORIZON_S). Between changes every `predict` returns the same, so callers may keep what they
        worked out from the predictions (service/planner.py keeps each option's predicted steps)."""
        if time.monotonic() > self._stale_at:
            with self._lock:
                self._changed(time.monotonic())
        return self._version

    def _changed(self, now: float) -> None:
        """Under the lock: a prediction changed; the next one to go stale sets `_stale_at`."""
        self._version += 1
        stamps = [t for t, _ in self._p90.values()]
        if self._slowdown is not None:
            stamps.append(self._slowdown[0])
        self._stale_at = min((t + HORIZON_S for t in stamps if t + HORIZON_S >= now), default=float("inf"))

    def profiled_p50(self, engine: str, batch: int = 1) -> float:
        """The builder's median, measured on an otherwise idle machine: what the engine itself costs."""
        return self.prior(engine, batch, "p50")

    def forget_if_starved(self) -> bool:
        """A request is about to be refused on the estimates: count the refusal, and drop every observation if over
        the last IDLE_S the engines ran less than once per STARVED such refusals (True: something was dropped).
        See the class's docstring."""
        with self._lock:
            if not self._p90 and self._slowdown is None:
                return False  # on the profiles: nothing to drop
            now = time.monotonic()
            refusals = self._refusals
            refusals.append(now)
            while now - refusals[0] > IDLE_S:  # kept to the window, so that its length is the count (O(1) a call)
                refusals.popleft()
            runs = _recent((t for t, _, _ in reversed(self._pooled)), now)  # every run is pooled
            if runs * STARVED >= len(refusals):
                return False
            self._refusals.clear()
            self._observed.clear()
            self._pooled.clear()
            self._p90.clear()
            self._count.clear()
            self._slowdown, self._pooled_count = None, 0
            self._changed(now)
            return True

    def observe(self, engine: str, batch: int, ms: float) -> float:
        """Record one service time; returns the prediction error (observed - predicted) in ms."""
        error = ms - self.predict(engine, batch)
        key = (engine, batch)
        now = time.monotonic()
        with self._lock:
            samples = self._observed.get(key)
            if samples is None:  # not setdefault: that builds a deque on every call
                samples = self._observed[key] = deque(maxlen=self._window)
            samples.append((now, ms))
            self._pooled.append((now, ms, self.prior(engine, batch, "p90")))
            count = self._count[key] = self._count.get(key, 0) + 1
            changed = False
            # Recomputing on every 10th sample keeps observe() cheap on the hot path.
            if count % 10 == 0:
                recent = sorted(v for t, v in samples if now - t <= HORIZON_S)
                if len(recent) >= MIN_OBSERVATIONS:
                    p90, old = _p90(recent), self._p90.get(key)
                    changed = _moved(old, p90, now)
                    self._p90[key] = (now, p90 if old is None or changed else old[1])
            self._pooled_count += 1
            if self._pooled_count % 10 == 0:
                observed = profiled = 0.0
                n = 0
                for t, v, p in self._pooled:
                    if now - t <= HORIZON_S:
                        observed, profiled, n = observed + v, profiled + p, n + 1
                if n >= MIN_OBSERVATIONS:
                    slowdown, old = max(observed / max(profiled, 1e-6), 1.0), self._slowdown
                    moved = _moved(old, slowdown, now)
                    changed |= moved
                    self._slowdown = (now, slowdown if old is None or moved else old[1])
            if changed:
                self._changed(now)
        return error


def _p90(ascending: list[float]) -> float:
    """The 90th percentile of sorted values, interpolated linearly between the two nearest as np.percentile does by
    default: the same figure, in a third of its time on a window of 200 (no array to build)."""
    position = 0.9 * (len(ascending) - 1)
    low = int(position)
    high = min(low + 1, len(ascending) - 1)
    return ascending[low] + (ascending[high] - ascending[low]) * (position - low)


def _moved(old: tuple[float, float] | None, new: float, now: float) -> bool:
    """Whether an estimate recomputed as `new` replaces `old` (when, value): it is new, `old` had gone stale, or it
    differs by more than STEADY. A smaller move is noise of the window's percentile, and keeping the old value keeps
    the predictions (and what the planner worked out from them) unchanged; its time is refreshed either way."""
    return old is None or now - old[0] > HORIZON_S or abs(new - old[1]) > STEADY * old[1]


def _recent(newest_first: Iterable[float], now: float) -> int:
    """How many of the times, newest first, are within IDLE_S of `now` (stops at the first older one)."""
    count = 0
    for t in newest_first:
        if now - t > IDLE_S:
            break
        count += 1
    return count
