"""A minimal HTTP/1.1 keep-alive client on asyncio protocols, for the load generator's hot path.

Why not httpx: on this repository's 2-vCPU machine, open-loop at 100 req/s against the service,
`httpx.AsyncClient` spent 4.4 ms of CPU per request (its pool re-scans its connections on every request)
and a client on asyncio streams 0.6 ms (both measured with getrusage over 300 requests). This one parses
responses in `data_received` without streams or extra tasks. The load generator shares the cores with the
server under test, so its CPU would be taken from the very thing it measures. Requests are pre-built byte
strings: nothing is encoded while the clock runs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from models.compat import timeout

# What a failed exchange can raise: refused/reset connections, a response cut short or malformed.
TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


def server_timing(value: str) -> dict[str, float]:
    """A `Server-Timing` header (`name;dur=ms, ...`, as service/timing.py writes it): each name's ms, in order."""
    phases = {}
    for part in value.split(","):
        name, _, ms = part.strip().partition(";dur=")
        phases[name] = float(ms)
    return phases


@dataclass
class Response:
    status: int
    body: bytes
    new_connection: bool = False  # the request opened a connection (none of the pool's was idle)

    def json(self) -> Any:
        return json.loads(self.body)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `exchange` sends a request and resolves with (response, keep-alive)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.waiter: asyncio.Future[tuple[Response, bool]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is not None and not self.waiter.done():
            try:
                parsed = _parse_response(self.buffer, eof=False)
            except ValueError as e:
                self.waiter.set_exception(e)
                return
            if parsed is not None:
                response, keep, used = parsed
                self.buffer = self.buffer[used:]
                self.waiter.set_result((response, keep))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        try:
            parsed = _parse_response(self.buffer, eof=True)
        except ValueError as e:
            self.waiter.set_exception(e)
            return
        if parsed is not None:  # a body delimited by the server closing
            self.waiter.set_result((parsed[0], False))
        else:
            self.waiter.set_exception(asyncio.IncompleteReadError(self.buffer, None))

    def exchange(self, request: bytes) -> asyncio.Future[tuple[Response, bool]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _parse_response(data: bytes, eof: bool) -> tuple[Response, bool, int] | None:
    """A complete response at the start of `data`: (response, keep-alive, bytes used); None if incomplete."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if eof and data:
            raise ValueError("the response ended inside its headers")
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip().lower() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    keep, start = headers.get("connection") != "close", end + 4
    if status in (204, 304) or status < 200:
        return Response(status, b""), keep, start
    if "content-length" in headers:
        stop = start + int(headers["content-length"])
        return (Response(status, data[start:stop]), keep, stop) if len(data) >= stop else None
    if headers.get("transfer-encoding") == "chunked":
        chunked = _parse_chunked(data, start)
        return None if chunked is None else (Response(status, chunked[0]), keep, chunked[1])
    return (Response(status, data[start:]), False, len(data)) if eof else None  # delimited by the close


def _parse_chunked(data: bytes, at: int) -> tuple[bytes, int] | None:
    chunks = []
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(data[at:line_end].split(b";")[0], 16)
        at = line_end + 2
        if size == 0:
            break
        if len(data) < at + size + 2:
            return None
        chunks.append(data[at : at + size])
        at += size + 2
    while True:  # trailers, then the empty line
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return None
        empty, at = line_end == at, line_end + 2
        if empty:
            return b"".join(chunks), at


class ConnectionPool:
    """Keep-alive connections to one server, reused most-recent first; at most `max_connections` open."""

    def __init__(self, url: str, max_connections: int) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {url!r}")
        self.host, self.netloc = parts.hostname, parts.netloc
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.ssl else 80)
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(max_connections)

    def request(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> bytes:
        """The whole request as bytes, built once and sent as many times as needed."""
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.netloc}\r\n"
        if body:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body

    async def send(self, request: bytes, timeout_s: float) -> Response:
        """Send on a pooled connection; raises asyncio.TimeoutError, or one of TRANSPORT_ERRORS."""
        async with self.slots, timeout(timeout_s):
            while self.idle:
                conn = self.idle.pop()
                if conn.closed:  # the server closed it while idle (keep-alive timeout)
                    continue
                try:
                    return await self._exchange(conn, request)
                except (ConnectionError, asyncio.IncompleteReadError) as e:
                    # A reused connection the server closed as we wrote: safe to retry once on a new one.
                    if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                        raise
                    break
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl)
            sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            response = await self._exchange(conn, request)
            response.new_connection = True
            return response

    async def _exchange(self, conn: _Connection, request: bytes) -> Response:
        try:
            response, keep = await conn.exchange(request)
        except BaseException:
            conn.close()
            raise
        if keep and not conn.closed:
            self.idle.append(conn)
        else:
            conn.close()
        return response

    async def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class BlockingConnection:
    """One keep-alive connection with a blocking socket: the cheapest client, for concurrency-1 timing."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        self.netloc = parts.netloc
        self.sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def request(
        self, method: str, path: str, body: bytes = b"", content_type: str = "application/json", **headers: str
    ) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.netloc}\r\n"
        head += "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
        if body:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body

    def send(self, request: bytes) -> tuple[Response, dict[str, str]]:
        """Send one pre-built request; the response and its headers (lower-case names). Content-Length only."""
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Response(int(lines[0].split(" ", 2)[1]), body), headers

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()
