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

The factor comes down slowly: from the ceiling, some 1,200 on-time answers bring it back to 1. The sweep runs
each cell for 1 s of warm-up and 600 requests at most, on a server that keeps its state from cell to cell, and
in the sweeps of 2026-11-28 `auto` came into the 10 ms cells with the caution that the 5 ms cells' late answers
had raised and spent most of each cell on quick single models (the MobileNetV2 -> VGG cascade, the best fixed plan
there, answered only after 65 and 82 % of two runs' requests, never in the third). A server whose clients change
their deadlines is in the same place. So each answer also says how large a factor it needed (`needed`): the
smallest that, applied to its plan's bare prediction, would have told a plan of this kind that came as late not to
run. With `window` > 0 the factor is capped by the (1 - target) quantile of what the last `window` answers
needed: caution can fall as soon as the answers show it is more than they need. The controller above still raises
it; a late answer's need is over the factor it had, so late answers lift the cap too, and one expired in the
queue (need: infinite) lifts it until it leaves the window.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque

TARGET_LATE = 0.01  # the share of auto's answers that may come late at equilibrium
STEP = 0.25  # one late answer: the factor grows by a quarter
CEILING = 16.0  # the factor never exceeds this (it would then pick the fastest option whatever the deadline)


class Caution:
    def __init__(
        self,
        target: float = TARGET_LATE,
        step: float = STEP,
        ceiling: float = CEILING,
        slack_ms: float = 0.0,
        window: int = 0,
    ) -> None:
        if not 0.0 < target < 1.0 or step <= 0.0 or ceiling < 1.0 or slack_ms < 0.0 or window < 0:
            raise ValueError("caution needs 0 < target < 1, step > 0, ceiling >= 1, slack_ms >= 0 and window >= 0")
        self.slack_ms = slack_ms  # an answer ready less than this before its deadline counts as late
        self._up = math.log1p(step)
        self._down = self._up * target / (1.0 - target)
        self._ceiling = math.log(ceiling)
        self._log = 0.0  # log of the factor; updates race benignly (a lost update is one observation fewer)
        # What the last answers needed (0: no cap): the cap is the value of rank ceil((1 - target) n) of n, i.e. the
        # `_top`-th largest of a full window. Answers come from the event loop and the worker: one lock.
        self._needs: deque[float] = deque(maxlen=window)
        self._top = window - math.ceil((1.0 - target) * window) + 1 if window else 0
        self._cap = math.inf
        self._lock = threading.Lock()

    @property
    def factor(self) -> float:
        return min(math.exp(self._log), self._cap)

    def answered(self, slack_ms: float, needed: float | None = None) -> None:
        """One answer of `auto`, ready `slack_ms` before its deadline (negative: after it; -inf: it expired in the
        queue): late when that is under the slack. `needed`: the factor it needed (see `needed`), if known."""
        self.observe(slack_ms < self.slack_ms)
        if needed is not None and self._top:
            with self._lock:
                self._needs.append(needed)
                if len(self._needs) == self._needs.maxlen:  # a full window: a quantile, not a few answers' whim
                    self._cap = max(1.0, heapq.nlargest(self._top, self._needs)[-1])

    def needed(self, time_left_ms: float, slack_ms: float, margin_ms: float, predicted_ms: float) -> float:
        """The factor an answer needed: its plan had `time_left_ms` (after the request's own path) for a bare
        prediction of `predicted_ms` (queue wait and the steps that ran) plus `margin_ms`, and was ready `slack_ms`
        before its deadline. Had the plan had `slack_ms - self.slack_ms` less time, it would have been just in time;
        a factor f lets a plan run only if f x predicted + margin fits the time left, so any f at or above
        (time left - slack + self.slack_ms - margin) / predicted would have kept a plan that came as late from
        running. Infinite when it expired in the queue."""
        if slack_ms == -math.inf:
            return math.inf
        return max(time_left_ms - slack_ms + self.slack_ms - margin_ms, 0.0) / max(predicted_ms, 1e-6)

    def observe(self, late: bool) -> None:
        """One answer of `auto`: late (after its deadline, or expired in the queue) or on time."""
        if late:
            self._log = min(self._log + self._up, self._ceiling)
        else:
            self._log = max(self._log - self._down, 0.0)
