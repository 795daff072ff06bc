"""Run the app under uvicorn: uvloop + httptools, no access log by default, bounded connections, load shedding
at the parser, clean SIGTERM.

uvicorn's own connection limit (`limit_concurrency`) answers in plain text, and its keep-alive timer starts
only after a first response, so a connection that never sends a request stays open. The protocol below
adds both limits the service needs, stamps when each request's parsing began, and refuses classify
requests straight from the parser while the event loop is behind (see `LoopLag`); everything else is
uvicorn's httptools protocol as it is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

import httptools
import orjson
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.admission import Admitted, admit
from service.awake import CoresAwake
from service.config import Settings
from service.errors import ApiError, Overloaded
from service.logs import log_config, request_id
from service.runtime import Runtime

CLASSIFY, BATCH = b"/v1/classify", b"/v1/classify/batch"
SWITCH_INTERVAL_S = 0.0005

# The flags that decide the request path's cost. The plain baseline (loadtest/baseline.py) runs under the
# same ones, so that a comparison measures the apps and not the servers (a test checks they agree).
UVICORN_FLAGS: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "access_log": False,
    "server_header": False,
    "date_header": False,
    "proxy_headers": False,
}


class LoopLag:
    """How far behind the event loop is, measured by the requests it starts.

    Each request waits from the moment the parser read it to the moment the app starts it: the loop first
    runs everything queued before it. That wait, averaged over the last requests (an exponential average, so
    that one stall of the machine does not count as overload), stands for how long the loop's rounds take
    now, and so for how long new data sits unread in the sockets meanwhile (which no clock in the server
    sees). While it is over `budget_ms` and recent, new classify requests are refused by the parser at once
    (503 overloaded): a refusal there costs a few percent of serving a request, so the loop catches up
    instead of queueing without bound, and refused clients know within milliseconds.

    Only with more than `min_connections` requests in flight (connections whose request is parsed and not yet
    answered): an HTTP/1.1 connection carries one request at a time, so that many clients that wait for their
    answers cannot overload the server: refusing them turns work into refusals (measured with 8 closed-loop
    clients on 2 cores, the loop fell 2 ms behind whenever the machine descheduled it, and 2-11 % of requests
    with 50 ms deadlines were refused 503 overloaded; tests/test_service.py runs that scenario). The floor is 8
    (service/config.py): the more requests in flight before shedding starts, the further behind the loop falls
    when load jumps, and the slower the first refusals (see `PollCap`). Requests in flight, not connections
    open: a client's pool of idle keep-alive connections holds no work. Counting open connections, a client that
    kept 32 open was refused at 70 % of capacity whenever the machine stalled
    (2026-11-26, exit 1 INT8, 1610 req/s, 5 ms deadlines, six 3 s trials each, side by side: 0-111 refused
    and 98.8 % on time at the client, against 0 refused and 99.9 % counting requests in flight).

    How far behind is too far depends on the deadlines: 2 ms matters to a 5 ms deadline, not to a 100 ms one. So
    the loop may fall `DEADLINE_SHARE` of the tightest deadline among the last `window` requests behind, when that
    is more than `budget_ms`. Shedding at 2 ms whatever the deadlines refused requests the server could answer in
    time: side by side at 950 req/s with 100 ms deadlines, about the keep-up capacity (six 3 s trials each,
    2026-11-27), 94.8 / 94.7 % (JSON / PNG) were answered 200 within 100 ms with one a turn, a floor of 8 and no
    deadline share, 97.7 / 98.9 % with the old two a turn and 16, and 99.2 / 99.9 % with the share.
    """

    WEIGHT = 0.2  # of the newest request in the average
    DEADLINE_SHARE = 0.4  # of the tightest recent deadline: how far behind the loop may fall, if over `budget_ms`

    def __init__(self, budget_ms: float, min_connections: int = 0, window: int = 64) -> None:
        self.budget_s, self.min_connections = budget_ms / 1e3, min_connections
        self.lag_s, self.at = 0.0, 0.0
        self._deadlines: deque[float] = deque(maxlen=window)

    def served(self, deadline_ms: float) -> None:
        """A classify request with this deadline was admitted (its deadline is known once its options are)."""
        self._deadlines.append(deadline_ms)

    def allowed_ms(self) -> float:
        """How far behind the loop may fall: `budget_ms`, or `DEADLINE_SHARE` of the tightest deadline among the
        last `window` requests admitted if that is more (none yet: `budget_ms`)."""
        return max(self.budget_s * 1e3, self.DEADLINE_SHARE * min(self._deadlines, default=0.0))

    def entered(self, received: float, now: float) -> None:
        self.lag_s += self.WEIGHT * ((now - received) - self.lag_s)
        self.at = now

    def behind_ms(self, now: float) -> float:
        """The average wait while requests keep being started; 0 once none has been for about that long."""
        return self.lag_s * 1e3 if now - self.at <= max(self.lag_s, 1e-3) else 0.0

    def overloaded(self, now: float, in_flight: Callable[[], int]) -> bool:
        """Further behind than allowed, with more than `min_connections` requests in flight (counted only then)."""
        behind = self.behind_ms(now)
        return behind > self.budget_s * 1e3 and behind > self.allowed_ms() and in_flight() > self.min_connections


def in_flight(connections: Iterable[Any]) -> int:
    """Connections whose request is being served: parsed, its response not yet complete (uvicorn's `cycle`)."""
    return sum(c.cycle is not None and not c.cycle.response_complete for c in connections)


class PollCap:
    """Under sustained overload, at most `per_poll` classify requests admitted per turn of the event loop.

    A turn reads every socket that has data, then runs what it admitted: requests that arrive meanwhile,
    refusals included, wait unread for the turn to end. Refusing everything while `LoopLag` is over budget
    is not enough: once the lag's average lapses, the next turn admits every request its reads hold, and
    that turn is long again. Measured at 4800 req/s, twice the keep-up capacity, on 2 vCPUs (exit 1 INT8,
    5 ms deadline, 3 s runs minutes apart, 2026-11-25): on connections the client had open, refusals' p99
    was 6.6-6.7 ms with `LoopLag` alone and 1.1-1.6 ms in eight runs with two per turn, which also answered
    more requests 200 (6572-7095 of about 14,400 against 4771 and 4924).

    A refusal waits for the turn that reads it, and a turn runs what the one before admitted, so the cap sets how
    fast refusals are. On a slower 2-vCPU machine, where an admitted request held the loop about 1 ms under load,
    two a turn made turns of 2 ms and more, and refusals waited for them (measured: 1.5 ms median from the client's
    send to the parser's read, 0.02 ms from the read to the refusal's write). So the default is one a turn, and
    `LoopLag`'s floor of requests in flight is 8, not 16: with 16, the first 0.1 s of a trial, before 16 were in
    flight, gave most of the slow refusals. Side by side at 1700 req/s, twice the keep-up capacity (exit 1 INT8, 5
    ms deadline, six 3 s trials each, 2026-11-27): refusals' client p99 was 3.4-9.2 ms (JSON) and 2.1-7.1 ms (PNG)
    against 11.9-20.8 and 3.3-31.5 ms with two a turn and 16, for 27 % (JSON) and 5 % (PNG) fewer answers 200.

    The cap is on from the moment `LoopLag` says overloaded. It stays on while it refuses at least
    `EXIT_SHARE / per_poll` as many requests as it admits, counted over `WINDOW_S` windows, so that at 70 % of
    capacity a passing stall of the machine ends it within a window. The share depends on the cap: a turn under
    the cap lasts about `per_poll` requests' work, and with Poisson arrivals a turn's arrivals beyond one are half
    the ones admitted at about 87 % of what the loop serves, those beyond two a quarter at about 78 %. (By the same
    arithmetic, a quarter at one a turn would keep the cap on down to about half.) Measured with two a turn at 1610-1700
    req/s in 3 s runs: 0-122 requests of about 5000 refused 503 overloaded in eight runs and 476 in a ninth,
    against 0-69 in five runs without the cap; `bench.frontdoor` kept 99.0-99.9 % on time at 5 ms at 70 % of
    capacity in three runs.
    """

    WINDOW_S = 0.05
    EXIT_SHARE = 0.5  # divided by per_poll: 0.5 at one a turn, 0.25 at two

    def __init__(self, per_poll: int) -> None:
        self.per_poll = per_poll
        self.on = self._armed = False
        self._used = self._admitted = self._refused = 0
        self._since = 0.0

    def admit(self, loop: asyncio.AbstractEventLoop, now: float, overloaded: bool) -> bool:
        """Whether to admit a classify request whose headers were just parsed."""
        if not self.on:
            if not overloaded:
                return True
            self.on = True
            self._new_window(now)
        elif now - self._since > self.WINDOW_S:
            if self._refused < self.EXIT_SHARE / self.per_poll * max(self._admitted, 1):
                self.on = False
                return True
            self._new_window(now)
        if not self._armed:  # runs after this turn's reads: the next turn starts a new count
            loop.call_soon(self._next_turn)
            self._armed = True
        if self._used >= self.per_poll:
            self._refused += 1
            return False
        self._used += 1
        self._admitted += 1
        return True

    def _new_window(self, now: float) -> None:
        self._since, self._admitted, self._refused = now, 0, 0

    def _next_turn(self) -> None:
        self._used, self._armed = 0, False


class Backlog:
    """Takes every connection waiting to be accepted at once, whenever one is.

    libuv, under uvloop, accepts one connection per turn of the event loop (since libuv 1.45, for fairness
    between processes sharing a socket). Under load a turn takes a millisecond or more, so a burst of new
    connections waited for as many turns: measured at 2x capacity, 20-47 ms (p50) from the client's connect
    to the server taking the connection, while requests on open connections were refused in about 1 ms.
    On each connection libuv accepts, this accepts the rest from a duplicate of the listening socket and hands
    them to the loop as uvicorn's own would be.
    """

    def __init__(self) -> None:
        self.listeners: list[socket.socket] = []
        self.factory: Callable[[], asyncio.Protocol] | None = None

    def open(self, fds: list[int], factory: Callable[[], asyncio.Protocol]) -> None:
        for fd in fds:
            listener = socket.socket(fileno=os.dup(fd))
            listener.setblocking(False)
            self.listeners.append(listener)
        self.factory = factory

    def take(self, loop: asyncio.AbstractEventLoop) -> None:
        for listener in self.listeners:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # none waiting (BlockingIOError); out of files and the like: libuv's to handle
                    break
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                loop.create_task(self._connect(loop, conn))

    async def _connect(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        assert self.factory is not None
        try:
            await loop.connect_accepted_socket(self.factory, conn)
        except OSError:  # the client left before the transport was set up
            conn.close()

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners.clear()


class _Refused:
    """Stands in for uvicorn's request cycle once the parser has answered: the rest of the request is ignored."""

    response_complete, disconnected, keep_alive, more_body = True, False, True, False

    def __init__(self) -> None:
        self.message_event = asyncio.Event()


def _answer(error: ApiError, rid: str) -> bytes:
    """A whole HTTP response for an error, written by the parser itself."""
    body = orjson.dumps(error.body())
    head = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
    head += f"x-request-id: {rid}\r\n"
    head += f"content-length: {len(body)}\r\n" + "".join(f"{k.lower()}: {v}\r\n" for k, v in error.headers.items())
    return (head + "\r\n").encode() + body


def protocol_class(
    max_connections: int, lag: LoopLag, cap: PollCap, runtime: Runtime, backlog: Backlog
) -> type[asyncio.Protocol]:
    metrics = runtime.metrics

    class Protocol(HttpToolsProtocol):
        """httptools, with a connection limit answered in JSON, a keep-alive timer from the first byte, the
        time each request's parsing began (the deadline clock starts there, before the loop queues it), and
        admission in the parser: a classify request that cannot be served is refused as soon as its headers
        are in (service/admission.py), and every one while the event loop is behind (LoopLag)."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"]["received"] = time.monotonic()

        def on_headers_complete(self) -> None:
            state = self.scope["state"]
            free = self.cycle is None or self.cycle.response_complete  # no response of this connection pending
            if free and self.parser.get_method() == b"POST":
                url = httptools.parse_url(self.url)
                if url.path in (CLASSIFY, BATCH):
                    try:
                        state["admitted"] = self._admit(url.path == BATCH, url.query or b"", state["received"])
                    except ApiError as e:
                        metrics.outcome("unknown", "", e.code).inc()
                        self._answer_now(e)
                        return
            state["loop_lag"], state["metrics"] = lag, metrics
            super().on_headers_complete()

        def _admit(self, batch: bool, query: bytes, received: float) -> Admitted:
            now = time.monotonic()
            # In flight <= open: with few connections open, neither the lag nor the cap is consulted.
            if len(self.connections) > lag.min_connections and not cap.admit(
                self.loop, now, lag.overloaded(now, lambda: in_flight(self.connections))
            ):
                raise Overloaded("the server is over capacity; retry shortly", headers={"Retry-After": "1"})
            return admit(runtime, {"headers": self.headers, "query_string": query}, batch, received)

        def _answer_now(self, error: ApiError) -> None:
            """Answered from the parser: no task, nothing waits behind the event loop's queue."""
            self.transport.write(_answer(error, request_id(self.headers)))
            self.cycle = _Refused()  # type: ignore[assignment]
            if self.parser.should_keep_alive():
                self.on_response_complete()
            else:
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            backlog.take(self.loop)
            if len(self.connections) > max_connections:
                # Every request on this connection sees the flag in scope["state"]; the app answers it
                # 503 too_many_connections with `connection: close` (service/app.py).
                self.app_state = {**self.app_state, "over_connection_limit": len(self.connections)}
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    return Protocol


class Server(uvicorn.Server):
    """On SIGTERM: refuse new work (503 shutting_down), let admitted work finish, then stop. With
    `keep_cores_awake`, the spinners of service/awake.py run from start-up to shutdown."""

    def __init__(
        self, config: uvicorn.Config, runtime: Runtime, backlog: Backlog, awake: CoresAwake | None = None
    ) -> None:
        super().__init__(config)
        self.runtime, self.backlog, self.awake = runtime, backlog, awake

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:  # as uvicorn's startup makes them
            return self.config.http_protocol_class(  # type: ignore[call-arg]
                config=self.config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop
            )

        self.backlog.open([s.fileno() for server in self.servers for s in server.sockets or ()], factory)
        if self.awake is not None:
            self.awake.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.awake is not None:
            self.awake.stop()
        self.backlog.close()
        self.runtime.scheduler.drain()
        await super().shutdown(sockets)


def uvicorn_config(app: FastAPI, settings: Settings, backlog: Backlog) -> uvicorn.Config:
    lag = LoopLag(settings.shed_after_ms, settings.shed_min_connections)
    cap = PollCap(settings.shed_per_poll)
    protocol = protocol_class(settings.max_connections, lag, cap, app.state.runtime, backlog)
    # The access log is service/app.py's (it names the request id); uvicorn's own is off.
    flags = {**UVICORN_FLAGS, "http": protocol, "access_log": False, "log_config": log_config(settings.log_format)}
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=settings.drain_timeout_s,
        log_level="info",
        **flags,
    )


def serve(app: FastAPI, settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT; returns normally after a graceful shutdown (exit status 0)."""
    # uvicorn re-raises the signal it caught once it has shut down, so that the default action ends the
    # process (status 143 for SIGTERM). A no-op handler installed first is what it restores and re-raises.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # A thread that wants the GIL waits until its holder blocks, or for this long. The event loop holds it
    # while busy, so with Python's default of 5 ms the worker could lose a whole deadline waiting to hand
    # back a finished batch.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    backlog = Backlog()
    awake = CoresAwake() if settings.keep_cores_awake else None
    Server(uvicorn_config(app, settings, backlog), app.state.runtime, backlog, awake).run()
