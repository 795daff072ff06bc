"""Where a request's time goes: cheap always-on phase timers, a `Server-Timing` header, Prometheus histograms.

Phases, in order (ms, all on the `time.monotonic()` clock the deadline uses):

- loop:     the HTTP parser began the request -> the app got it: the event loop's backlog
- receive:  the app got it -> the whole body read
- parse:    body -> fields (JSON, multipart, query, raw bytes)
- validate: fields -> checked options
- decode:   image bytes / pixel arrays / tensors -> model input
- plan:     choosing the plan from the profiles and the live queue
- enqueue:  handing the job to the scheduler
- queue:    in the scheduler but not in an engine: the wake-up of the worker thread, waiting behind earlier-due
            work, and between the stages of a cascade
- run:      inside engines, all steps
- handback: the last engine done -> the request's coroutine running again on the event loop
- encode:   the answer -> JSON bytes

What happens before the parser sees the request (accept, the socket's buffer while the event loop is busy)
is not visible here: `bench.frontdoor` measures it as client latency minus the answer's `latency_ms`.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

PHASES = ("loop", "receive", "parse", "validate", "decode", "plan", "enqueue", "queue", "run", "handback", "encode")
BUCKETS_MS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0)


class Clock:
    """Laps since the request's arrival; one `time.monotonic()` call per phase."""

    __slots__ = ("arrival", "last", "ms")

    def __init__(self, arrival: float) -> None:
        self.arrival = self.last = arrival
        self.ms: dict[str, float] = {}

    def lap(self, phase: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self.ms[phase] = (now - self.last) * 1e3
        self.last = now
        return now

    def add(self, phase: str, ms: float) -> None:
        self.ms[phase] = ms

    def server_timing(self) -> bytes:
        """The `Server-Timing` header value: each phase, then `app` (arrival to now) in ms."""
        total = (time.monotonic() - self.arrival) * 1e3
        parts = [f"{p};dur={self.ms[p]:.3f}" for p in PHASES if p in self.ms]
        parts.append(f"app;dur={total:.3f}")
        return ", ".join(parts).encode()


class PhaseHistograms(Collector):
    """`anytime_phase_ms{phase}`: one histogram per phase, kept as plain counters.

    A prometheus_client Histogram takes a lock per observation; ten of them per request cost more than
    some phases they measure. Observations come from the event loop thread only, so plain lists will do.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counts = {p: [0] * (len(BUCKETS_MS) + 1) for p in PHASES}
        self.sums = dict.fromkeys(PHASES, 0.0)
        registry.register(self)

    def observe(self, ms: dict[str, float]) -> None:
        for phase, value in ms.items():
            self.counts[phase][bisect_left(BUCKETS_MS, value)] += 1
            self.sums[phase] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "anytime_phase_ms", "Time per request phase, ms (see service/timing.py)", labels=["phase"]
        )
        for phase in PHASES:
            counts, running, buckets = self.counts[phase], 0, []
            for bound, n in zip((*BUCKETS_MS, float("inf")), counts, strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
            family.add_metric([phase], buckets, self.sums[phase])
        yield family


class PathTime:
    """What a request spends after its plan is made and outside the engines: the median of the last requests.

    A plan is made before the image is decoded and handed to the scheduler, and the answer is built after
    the worker hands the job back; the planner's predictions (queue wait, engine times) see neither. Left
    out, a deadline that only the engine fits is admitted, computed, and answered 504 as late (measured on
    2026-11-25, 2 ms deadlines on an idle 2-vCPU server: 5 of 20). So the planner takes this much off the
    time left. The median, not a tail: the safety margin and `auto`'s caution cover the tail.

    Only from `min_samples` answers on: the first answers after start-up take longer (measured on a fresh
    server: 1.5 ms after the plan for the first, 0.3 ms by the tenth), and one of them alone made every 2 ms
    request that followed infeasible, so no answer came to correct it (399 of 400 refused in a 2 s run).
    Only while requests keep being answered: once none has been for `horizon_s`, the estimate is dropped
    (0 again). Under overload the hand-back waits behind the event loop's backlog and the median grows; a
    plan that allows for it refuses tight deadlines, and when every request is refused no new answer could
    ever bring it down (measured: after an overload trial every 5 ms request was refused at 25 % load).

    Nor while requests are refused on it and none answered: after `starved` refusals in a row with no answer
    between them, the estimate is dropped (`refused`), as the predictor drops its own (service/predictor.py).
    The horizon alone did not end such a lock under load: the few answers of requests admitted earlier kept it
    fresh. Measured on 2026-11-26 (night; 800 req/s, 5 ms deadlines, `auto`, PNG bodies, 4 s): the estimate
    grew to 6-8 ms while the event loop was behind, and the server then refused 3175 of 3241 requests
    (`deadline_infeasible`, "no plan can answer within -1.23 ms ... queue 0.00") on an event loop that the
    refusals had long let catch up, and went on refusing for over a second after the load stopped. With the
    rule, in three 4 s runs: 99-135 refused so, and 40-46 % of the requests correct and on time at the client.
    """

    def __init__(
        self, window: int = 128, every: int = 16, horizon_s: float = 2.0, min_samples: int = 8, starved: int = 20
    ) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._every, self._count, self._horizon_s, self._min = every, 0, horizon_s, min_samples
        self._median, self._last = 0.0, 0.0
        self._starved, self._refusals = starved, 0

    @property
    def ms(self) -> float:
        fresh = time.monotonic() - self._last <= self._horizon_s
        return self._median if fresh and len(self._samples) >= self._min else 0.0

    def observe(self, ms: float) -> None:
        """One request's post-plan time (event loop thread only)."""
        now = time.monotonic()
        if now - self._last > self._horizon_s:
            self._samples.clear()  # from another time: the load then says nothing of now
        self._samples.append(ms)
        self._last, self._refusals = now, 0
        self._count += 1
        if self._count % self._every == 0 or len(self._samples) < self._every:
            self._median = statistics.median(self._samples)

    def refused(self) -> bool:
        """A plan that allowed for this estimate refused a request: count it, and drop the estimate (0 until
        `min_samples` answers again) at the `starved`-th refusal with no answer since the last. True: dropped."""
        if self.ms == 0.0:
            return False
        self._refusals += 1
        if self._refusals < self._starved:
            return False
        self._samples.clear()
        self._median, self._refusals = 0.0, 0
        return True
