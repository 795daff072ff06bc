"""The front door's load-shedding rule, without a server."""

from __future__ import annotations

from service.server import LoopLag


def test_shedding_needs_a_lagging_loop_and_more_connections_than_clients_that_wait() -> None:
    lag = LoopLag(budget_ms=2.0, min_connections=16)
    now = 100.0
    for i in range(20):  # every request waited 5 ms for the loop
        lag.entered(now + i * 1e-3 - 5e-3, now + i * 1e-3)
    later = now + 19e-3
    assert lag.behind_ms(later) > 2.0
    assert lag.overloaded(later, connections=17)
    assert not lag.overloaded(later, connections=16)  # 16 clients that wait for answers cannot overload it
    assert not lag.overloaded(later + 1.0, connections=500)  # no request started for a second: caught up
    quiet = LoopLag(budget_ms=2.0, min_connections=16)
    quiet.entered(now - 1e-4, now)
    assert not quiet.overloaded(now, connections=500)  # not behind
