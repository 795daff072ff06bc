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
"""

from __future__ import annotations

import math

TARGET_LATE = 0.01  # the share of auto's answers that may come late at equilibrium
STEP = 0.25  # one late answer: the factor grows by a quarter
CEILING = 16.0  # the factor never exceeds this (it would then pick the fastest option whatever the deadline)


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
