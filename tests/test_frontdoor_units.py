"""The front door's load-shedding rules and its accept-all backlog, without a server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from service.server import Backlog, LoopLag, PollCap, in_flight


def test_shedding_needs_a_lagging_loop_and_more_requests_in_flight_than_clients_that_wait() -> None:
    lag = LoopLag(budget_ms=2.0, min_connections=16)
    now = 100.0
    for i in range(20):  # every request waited 5 ms for the loop
        lag.entered(now + i * 1e-3 - 5e-3, now + i * 1e-3)
    later = now + 19e-3
    assert lag.behind_ms(later) > 2.0
    assert lag.overloaded(later, lambda: 17)
    assert not lag.overloaded(later, lambda: 16)  # 16 clients that wait for answers cannot overload it
    assert not lag.overloaded(later + 1.0, lambda: 500)  # no request started for a second: caught up
    quiet = LoopLag(budget_ms=2.0, min_connections=16)
    quiet.entered(now - 1e-4, now)
    counted: list[int] = []
    assert not quiet.overloaded(now, lambda: counted.append(1) or 500)  # not behind ...
    assert not counted  # ... so the connections were not counted


def test_the_loop_may_fall_further_behind_while_every_recent_deadline_is_loose() -> None:
    lag = LoopLag(budget_ms=2.0, min_connections=0, window=4)
    now = 100.0
    for i in range(20):  # every request waited 10 ms for the loop
        lag.entered(now + i * 1e-3 - 10e-3, now + i * 1e-3)
    later = now + 19e-3
    assert lag.allowed_ms() == 2.0 and lag.overloaded(later, lambda: 1)  # no deadline seen yet: the budget
    for _ in range(4):
        lag.served(100.0)
    assert lag.allowed_ms() == 40.0  # 10 ms behind cannot make a 100 ms deadline late: no shedding
    assert not lag.overloaded(later, lambda: 1)
    lag.served(5.0)  # one tight deadline among the last four: shedding at the budget again
    assert lag.allowed_ms() == 2.0 and lag.overloaded(later, lambda: 1)
    for _ in range(3):
        lag.served(50.0)
    assert lag.allowed_ms() == 2.0  # the 5 ms one is still among the last four
    lag.served(50.0)
    assert lag.allowed_ms() == 20.0 and not lag.overloaded(later, lambda: 1)


class _Cycle:
    def __init__(self, complete: bool) -> None:
        self.response_complete = complete


class _Connection:
    def __init__(self, cycle: _Cycle | None) -> None:
        self.cycle = cycle


def test_requests_in_flight_count_connections_with_an_unfinished_response_not_idle_ones() -> None:
    idle = [_Connection(None)] * 20 + [_Connection(_Cycle(complete=True))] * 12  # a client's keep-alive pool
    busy = [_Connection(_Cycle(complete=False))] * 3
    assert in_flight(idle) == 0
    assert in_flight(idle + busy) == 3


class _Turns:
    """Stands in for the event loop's call_soon: what it schedules runs when the test ends the turn."""

    def __init__(self) -> None:
        self.soon: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.soon.append(callback)

    def end_turn(self) -> None:
        soon, self.soon = self.soon, []
        for callback in soon:
            callback()


def test_poll_cap_admits_all_until_overloaded_then_two_a_turn_until_demand_falls() -> None:
    loop, cap, now = _Turns(), PollCap(per_poll=2), 100.0
    assert all(cap.admit(loop, now, overloaded=False) for _ in range(10))  # no cap without overload
    assert not cap.on and not loop.soon
    admitted = [cap.admit(loop, now, overloaded=True) for _ in range(5)]
    assert admitted == [True, True, False, False, False]  # overloaded: two of this turn's reads
    assert cap.on
    loop.end_turn()
    # the lag's average has lapsed, but demand has not: the cap stays on, two a turn
    assert [cap.admit(loop, now + 0.01, overloaded=False) for _ in range(4)] == [True, True, False, False]
    loop.end_turn()
    now += PollCap.WINDOW_S + 0.001  # a window with 4 admitted and 5 refused: still over demand
    assert [cap.admit(loop, now, overloaded=False) for _ in range(3)] == [True, True, False]
    loop.end_turn()
    for turn in range(4):  # demand falls to one a turn: nothing refused
        assert cap.admit(loop, now + turn * 0.001, overloaded=False)
        loop.end_turn()
    assert cap.on
    assert all(cap.admit(loop, now + PollCap.WINDOW_S + 0.01, overloaded=False) for _ in range(5))
    assert not cap.on  # the window refused less than a quarter of what it admitted: the cap is off


def test_poll_cap_at_one_a_turn_ends_when_a_window_refuses_less_than_half_what_it_admits() -> None:
    loop, cap, now = _Turns(), PollCap(per_poll=1), 100.0

    def window(start: float, arrivals: list[int]) -> list[bool]:
        seen = []
        for turn, n in enumerate(arrivals):
            seen += [cap.admit(loop, start + turn * 0.001, overloaded=False) for _ in range(n)]
            loop.end_turn()
        return seen

    assert cap.admit(loop, now, overloaded=True) and not cap.admit(loop, now, overloaded=True)
    loop.end_turn()
    assert window(now + 0.001, [2, 2, 2, 1]).count(False) == 3  # 5 admitted, 4 refused, with the first turn: on
    assert cap.on
    # near capacity: 7 turns of one arrival, 3 of two (as Poisson arrivals at about 80 %): 10 admitted, 3 refused
    assert window(now + PollCap.WINDOW_S + 0.002, [1, 2, 1, 1, 2, 1, 1, 2, 1, 1]).count(False) == 3
    assert cap.on  # the window before was still over demand
    assert cap.admit(loop, now + 2 * PollCap.WINDOW_S + 0.01, overloaded=False)
    assert not cap.on  # 3 refused against 10 admitted: under half, off (at two a turn a quarter would keep it on)


def test_backlog_accepts_every_waiting_connection_at_once() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        made: list[asyncio.Transport] = []

        class Recorder(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(transport)  # type: ignore[arg-type]

        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        backlog = Backlog()
        backlog.open([listener.fileno()], Recorder)
        clients = [socket.create_connection(listener.getsockname()) for _ in range(5)]
        backlog.take(loop)  # one call: all five, where libuv takes one per turn
        for _ in range(20):
            if len(made) == 5:
                break
            await asyncio.sleep(0.01)
        backlog.close()
        listener.close()
        for c in clients:
            c.close()
        for t in made:
            t.close()
        return len(made)

    assert asyncio.run(scenario()) == 5
