"""Caution: how far `auto` inflates its predicted times, set by feedback from its own late answers.

The planner predicts a plan's completion from the queue ahead and each engine's recent p99. What it cannot
see makes answers late anyway: the event loop's backlog of requests not yet parsed, time after the answer
(encoding, sending), another process on the same cores, and the cost that an expensive plan imposes on the
requests queued behind it. Measured in the sweep (2026-11-24): `auto` picked the most accurate option whose
predicted worst case fitted, and 10-50 % of its answers came late under load, where the cheaper fixed plans'
did not.

Late means late at the client, which the server cannot see: what follows its clock (writing the answer, the
client reading it) takes 0.2-0.3 ms typically and 1-2 ms at the tail under load. So the planner counts an
answer ready less than a slack (`auto_caution_slack_ms`, 0.5 ms by default) before its deadline as late too.
Measured in the sweep of 2026-11-25 (`auto`'s records): all 725 answers late at the client had been on time
at the server; at 3 ms, of the answers ready within 0.5 ms of the deadline, 12 of 19 (200 req/s) and 20 of 31
(600 req/s) arrived late, against 1.4-1.5 % of the others. In two full sweeps that evening, side by side with
the rule before (`auto-server-late`), the slack put 4.2 and 3.0 pp more of `auto`'s requests on time at the client
at 2 ms (effective accuracy +2.7 and +1.3 pp) and 1.2 and 1.1 pp more at 3 ms (-0.3 and +0.4 pp); at 5 ms it
cost 0.5 and 0.1 pp; at 10 and 20 ms nothing.

So `auto` multiplies every predicted time (queue wait and steps) by a factor >= 1 when it chooses an option
and when it decides whether a cascade goes on. Each late answer of `auto` multiplies the factor by
`1 + step`; each on-time one divides it by `(1 + step) ** (target / (1 - target))`, so it settles where about
`target` of the answers are late (additive-increase / multiplicative-decrease in log space, as brownout
controllers and TCP do).

Caution never decides whether a request is refused: that stays on uninflated predictions, so caution changes
which answer a request gets, not whether it gets one.

One caution per band of deadlines (`ByDeadline`: [1, 2) ms, [2, 4) ms, [4, 8) ms, ...), not one for every request.
What makes answers late is mostly time of fixed length (the path after the server's clock, a stall), which a tight
deadline cannot absorb and a loose one can; one factor learnt from 3 ms requests inflated a 10 ms request's
predictions as much. Measured in the sweep of 2026-11-28 (midday; `auto` runs on a server of its own, which keeps
its state from cell to cell, as a server does when its clients' deadlines change): `auto`'s caution and load
restraint (service/load.py, the same controller) came into the 200 req/s, 10 ms cell raised by the 5 ms cell's late
answers (from the ceiling, some 1,200 on-time answers bring one back to 1). Its first answers there came from the
quick step that answers where caution leaves no option, then from quick single models (MobileNetV2 FP32 and mirror
INT8, exit 1 INT8); the MobileNetV2 -> VGG cascade, which then answered most
requests and scored 94.7 % as a fixed column (`auto` 92.4 %), answered 10 in a row only after 65 % and 82 % of two
runs' requests, and never in the third. Clients with different deadlines on one server are the same case.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

TARGET_LATE = 0.01  # the share of auto's answers that may come late at equilibrium
STEP = 0.25  # one late answer: the factor grows by a quarter
CEILING = 16.0  # the factor never exceeds this (it would then pick the fastest option whatever the deadline)
ACTIVE_S = 1.0  # a band of deadlines with a request this recent is active (ByDeadline.strictest)


class Caution:
    def __init__(
        self, target: float = TARGET_LATE, step: float = STEP, ceiling: float = CEILING, slack_ms: float = 0.0
    ) -> None:
        if not 0.0 < target < 1.0 or step <= 0.0 or ceiling < 1.0 or slack_ms < 0.0:
            raise ValueError("caution needs 0 < target < 1, step > 0, ceiling >= 1 and slack_ms >= 0")
        self.slack_ms = slack_ms  # an answer ready less than this before its deadline counts as late
        self._up = math.log1p(step)
        self._down = self._up * target / (1.0 - target)
        self._ceiling = math.log(ceiling)
        self._log = 0.0  # log of the factor; updates race benignly (a lost update is one observation fewer)

    @property
    def factor(self) -> float:
        return math.exp(self._log)

    def answered(self, slack_ms: float) -> None:
        """One answer of `auto`, ready `slack_ms` before its deadline (negative: after it; -inf: it expired in the
        queue): late when that is under the slack."""
        self.observe(slack_ms < self.slack_ms)

    def observe(self, late: bool) -> None:
        """One answer of `auto`: late (after its deadline, or expired in the queue) or on time."""
        if late:
            self._log = min(self._log + self._up, self._ceiling)
        else:
            self._log = max(self._log - self._down, 0.0)


class ByDeadline:
    """A Caution per band of request deadlines, each a factor of two wide (see the module's docstring): made on the
    first request of its band, by `make`. `new_band` is told of each new one (service/runtime.py: its gauges)."""

    def __init__(self, make: Callable[[], Caution] = Caution) -> None:
        self._make = make
        self._bands: dict[int, Caution] = {}
        self._used: dict[int, float] = {}  # when each band was last asked for (time.monotonic())
        self.new_band: Callable[[float, Caution], None] = lambda low_ms, caution: None

    def __call__(self, deadline_ms: float, now: float | None = None) -> Caution:
        band = _band(deadline_ms)
        self._used[band] = time.monotonic() if now is None else now
        caution = self._bands.get(band)
        if caution is None:  # two threads may both get here: setdefault keeps one, new_band is idempotent
            caution = self._bands.setdefault(band, self._make())
            self.new_band(math.ldexp(1.0, band - 1), caution)
        return caution

    def strictest(self, deadline_ms: float, now: float | None = None) -> float:
        """The largest factor of this deadline's band and of the tighter bands active now (asked for within ACTIVE_S):
        what service/load.py divides a request's load budget by. The load is shared: engine time given to a loose
        request delays the tight ones queued behind it, whose late answers raise only their own band's factor; a
        tighter band no longer sent holds nothing back."""
        now = time.monotonic() if now is None else now
        own = _band(deadline_ms)
        factor = self(deadline_ms, now).factor
        for band, caution in list(self._bands.items()):  # a copy: another thread may add a band
            if band < own and now - self._used.get(band, -math.inf) <= ACTIVE_S:
                factor = max(factor, caution.factor)
        return factor


def _band(deadline_ms: float) -> int:
    """The band of a deadline: it is in [2 ** (band - 1), 2 ** band) ms."""
    return math.frexp(min(max(deadline_ms, 1e-3), 1e9))[1]


def for_deadline(caution: Caution | ByDeadline | None, deadline_ms: float) -> Caution | None:
    """The Caution that governs a request with this deadline: its band's, or the one for all."""
    return caution(deadline_ms) if isinstance(caution, ByDeadline) else caution


def band_label(low_ms: float) -> str:
    """A band's name in the metrics: its bounds in ms, e.g. "8-16"."""
    return f"{low_ms:g}-{2 * low_ms:g}"
