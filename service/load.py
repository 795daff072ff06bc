"""Load: how fast requests arrive, and so how much engine time `auto` can afford to give each one.

`auto` used to take, per request, the most accurate option whose own worst case fitted the deadline, as if
the request were alone. Under load that is the wrong question: an option that costs 2 ms a request at 500
requests a second asks for a whole core and more, the queue grows, and the requests behind it miss their
deadlines (the sweep of 2026-11-24: `auto` fell 10-48 pp below the best fixed plan at 250-500 req/s, with
10-50 % of its answers late, while the cheap stage cascade kept up).

So `auto` also weighs what an option costs on average (its steps' medians in the build's profile, each weighted by
how often the step runs: a cascade mostly stops after its first model) against a budget per request: the share of one
engine core it may use (`utilization`) divided by the arrival rate. At 100 req/s and 0.7 the budget is 7 ms
a request, which every option meets; at 700 req/s it is 1 ms, and the dear options drop out. When none is
within the budget, the cheapest option that fits the deadline answers (utilization queueing theory says
waits grow as 1 / (1 - utilization): near 1 they explode, so the rule stays below it).

The arrival rate is an exponentially decayed count of requests (time constant `tau_s`): each arrival adds
1 / tau, and the sum decays by e^(-dt / tau); under steady arrivals it equals their rate.

A core of engine time is what the worker could use on an otherwise idle machine; it never gets that. On the 2-vCPU
machines here the HTTP front door, the decoding and the load generator share the cores, and the sweep of 2026-11-28
(morning, docs/measurements.md) found `auto` at 600 req/s and 5 ms choosing MobileNetV2 FP32 (0.40 ms typical, well
within the rate's 1.17 ms) for most requests, queueing behind it, and refusing 487 of 1,800 requests as infeasible
(27 %) where fixed ResNet exit 1 INT8 (0.25 ms) refused 152: 55 % on time against 84 %. So the budget has its own
feedback (`restraint`, the AIMD controller of service/caution.py): it is divided by a factor that grows with each
answer of `auto` late or expired in the queue (as caution counts them) and each request of `auto` refused because
of the queue ahead of it (it would have fitted an empty one), and shrinks with each on-time answer, so that about
1 % of `auto`'s requests end so at equilibrium. Where even the cheapest option loses more than that, the factor
stays at its ceiling and the cheapest option that fits the deadline answers; at low load the rate's budget is so
wide that the factor changes nothing.
"""

from __future__ import annotations

import math
import threading
import time

from service.caution import Caution


class ArrivalRate:
    def __init__(self, tau_s: float = 1.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self._rate, self._at = 0.0, time.monotonic()
        self._lock = threading.Lock()  # arrivals come from the event loop, re-plans from the worker

    def arrive(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._rate = self._decayed(now) + 1.0 / self.tau_s
            self._at = now

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._decayed(now)

    def _decayed(self, now: float) -> float:
        return self._rate * math.exp(-max(now - self._at, 0.0) / self.tau_s)


class Budget:
    """The engine time `auto` may spend on one request: `utilization` seconds of engine per second of wall
    time, shared among the requests arriving meanwhile, divided by the restraint's factor (None: by 1)."""

    def __init__(
        self, utilization: float = 0.7, rate: ArrivalRate | None = None, restraint: Caution | None = None
    ) -> None:
        if not 0.0 < utilization <= 4.0:
            raise ValueError("utilization must be in (0, 4]")
        self.utilization = utilization
        self.rate = rate or ArrivalRate()
        self.restraint = restraint

    def ms(self, now: float | None = None) -> float:
        """ms of engine time per request now (infinite while no request has arrived)."""
        per_s = self.rate.per_second(now)
        if per_s <= 0.0:
            return math.inf
        return self.utilization / per_s * 1e3 / (self.restraint.factor if self.restraint is not None else 1.0)

    def answered(self, slack_ms: float) -> None:
        """An answer of auto, ready `slack_ms` before its deadline (-inf: it expired in the queue)."""
        if self.restraint is not None:
            self.restraint.answered(slack_ms)

    def refused_for_the_queue(self) -> None:
        """A request of auto refused as infeasible that an empty queue would have let through."""
        if self.restraint is not None:
            self.restraint.observe(True)
