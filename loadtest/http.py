"""A minimal HTTP/1.1 keep-alive client over asyncio streams, for the load generator's hot path.

Why not httpx: on this repository's 2-vCPU machine, open-loop at 100 req/s against the service,
`httpx.AsyncClient` spent 4.4 ms of CPU per request (its pool re-scans its connections on every request)
and this client 0.6 ms (both measured with getrusage over 300 requests). The load generator shares the
cores with the server under test, so its CPU would be taken from the very thing it measures.
Requests are pre-built byte strings: nothing is encoded while the clock runs.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# What a failed exchange can raise: refused/reset connections, a response cut short or malformed.
TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


@dataclass
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class ConnectionPool:
    """Keep-alive connections to one server, reused most-recent first; at most `max_connections` open."""

    def __init__(self, url: str, max_connections: int) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {url!r}")
        self.host, self.netloc = parts.hostname, parts.netloc
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.ssl else 80)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.slots = asyncio.Semaphore(max_connections)

    def request(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> bytes:
        """The whole request as bytes, built once and sent as many times as needed."""
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.netloc}\r\n"
        if body:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body

    async def send(self, request: bytes, timeout_s: float) -> Response:
        """Send on a pooled connection; raises TimeoutError, or one of TRANSPORT_ERRORS."""
        async with self.slots, asyncio.timeout(timeout_s):
            while self.idle:
                reader, writer = self.idle.pop()
                if reader.at_eof():  # the server closed it while idle (keep-alive timeout)
                    writer.close()
                    continue
                try:
                    return await self._exchange(reader, writer, request)
                except (ConnectionError, asyncio.IncompleteReadError) as e:
                    # A reused connection the server closed as we wrote: safe to retry once on a new one.
                    if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                        raise
                    break
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
            return await self._exchange(reader, writer, request)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Response:
        try:
            writer.write(request)
            response, keep = await _read_response(reader)
        except BaseException:
            writer.close()
            raise
        if keep:
            self.idle.append((reader, writer))
        else:
            writer.close()
        return response

    async def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[Response, bool]:
    """One response: status, headers, body by Content-Length or chunks; and whether the connection stays open."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip().lower() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    keep = headers.get("connection") != "close"
    if status in (204, 304) or status < 200:
        return Response(status, b""), keep
    if "content-length" in headers:
        return Response(status, await reader.readexactly(int(headers["content-length"]))), keep
    if headers.get("transfer-encoding") == "chunked":
        return Response(status, await _read_chunked(reader)), keep
    return Response(status, await reader.read()), False  # delimited by the server closing


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        chunks.append((await reader.readexactly(size + 2))[:-2])
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the empty line
        pass
    return b"".join(chunks)
