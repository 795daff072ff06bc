"""The load generator: sends labelled test images to a running server and records every answer.

`server` scenario: open-loop Poisson arrivals; each request leaves at its scheduled time whether or not
earlier ones have been answered, so a slow server shows up as queueing instead of a slower sender.
`single-stream`: the next request leaves when the last one is answered.

One asyncio loop and one pool of keep-alive connections (`loadtest/http.py`, far cheaper in CPU than
httpx): connections are reused, and the pool is large enough that requests do not queue for one.
Requests are encoded before the run so that PNG, JSON and HTTP encoding are not in the timing.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import numpy as np
import uvloop
from tqdm import tqdm

from loadtest.harness import png_base64
from loadtest.http import TRANSPORT_ERRORS, ConnectionPool
from loadtest.schedule import DeadlineMix, Workload, arrival_rng, make_workload, poisson_offsets
from loadtest.summary import Record, summarize, write_records
from models.compat import StrEnum
from models.data import Split

MAX_CONNECTIONS = 512  # below the usual 1024 open-file limit; more outstanding requests wait for one
WARM_CONNECTIONS = 8


class Scenario(StrEnum):
    SERVER = "server"
    SINGLE_STREAM = "single-stream"


class RemoteTargetRefused(ValueError):
    """A load target outside loopback without --allow-remote."""


def check_target(url: str, allow_remote: bool = False) -> None:
    """Refuse any host but loopback (127.0.0.0/8, localhost, ::1) unless `allow_remote`; no name is resolved."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise RemoteTargetRefused(f"no host in url {url!r}")
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise RemoteTargetRefused(
            f"refusing to send load to {host}: not a loopback address (127.0.0.0/8, localhost, ::1); "
            "pass --allow-remote to load a server you run elsewhere"
        )


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    scenario: Scenario = Scenario.SERVER
    rate: float = 100.0  # requests/s, server scenario
    requests: int = 1000  # stop after this many sends ...
    duration_s: float = 10.0  # ... or this long after the start, whichever comes first
    deadlines: DeadlineMix = field(default_factory=lambda: DeadlineMix.single(10.0))
    policy: str = "auto"  # the server's default policy
    rung: str | None = None
    on_infeasible: str = "reject"
    timeout_s: float = 10.0  # a request with no answer by then is recorded as client_timeout
    seed: int = 0
    body: str = "json"  # json: base64 PNG in a JSON body; png: the PNG file as the body, options in the query
    warm_connections: int = WARM_CONNECTIONS  # keep-alive connections opened before the clock starts

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["deadlines"] = {"deadlines_ms": self.deadlines.deadlines_ms, "probabilities": self.deadlines.probabilities}
        return d


def encode_requests(config: LoadConfig, split: Split, workload: Workload, pool: ConnectionPool) -> list[bytes]:
    """Every request as HTTP bytes, encoded once (each distinct image's PNG only once)."""
    pngs = {int(i): png_base64(split.images[i]) for i in np.unique(workload.images)}
    options: dict[str, Any] = {"policy": config.policy, "on_infeasible": config.on_infeasible}
    if config.rung is not None:
        options["rung"] = config.rung
    if config.body == "png":
        query = urlencode(options)
        return [
            pool.request(
                "POST", f"/v1/classify?deadline_ms={float(d)}&{query}", base64.b64decode(pngs[int(i)]), "image/png"
            )
            for i, d in zip(workload.images, workload.deadlines_ms, strict=True)
        ]
    return [
        pool.request(
            "POST", "/v1/classify", json.dumps({"image": pngs[int(i)], "deadline_ms": float(d), **options}).encode()
        )
        for i, d in zip(workload.images, workload.deadlines_ms, strict=True)
    ]


class _Sender:
    """Sends request i and turns whatever comes back into a Record."""

    def __init__(
        self, pool: ConnectionPool, requests: list[bytes], workload: Workload, split: Split, timeout_s: float
    ) -> None:
        self.pool, self.requests, self.workload, self.split, self.timeout_s = pool, requests, workload, split, timeout_s
        self.start = 0.0

    async def send(self, i: int, scheduled_s: float | None) -> Record:
        sent = time.perf_counter()
        image = int(self.workload.images[i])
        record = Record(
            i=i,
            image=image,
            label=int(self.split.labels[image]),
            deadline_ms=float(self.workload.deadlines_ms[i]),
            send_s=sent - self.start,
            lag_ms=max(0.0, (sent - self.start - scheduled_s) * 1e3) if scheduled_s is not None else 0.0,
            client_ms=0.0,
            status=0,
            code="",
        )
        try:
            response = await self.pool.send(self.requests[i], self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            record.client_ms, record.code = (time.perf_counter() - sent) * 1e3, "client_timeout"
            return record
        except TRANSPORT_ERRORS:
            record.client_ms, record.code = (time.perf_counter() - sent) * 1e3, "transport_error"
            return record
        record.client_ms = (time.perf_counter() - sent) * 1e3
        record.status, record.new_connection = response.status, response.new_connection
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            record.code = "bad_body"
        elif response.status != 200:
            record.code = str(body.get("code", f"http_{response.status}"))
        else:
            record.code = "ok"
            record.server_ms, record.queue_ms = body.get("latency_ms"), body.get("queue_ms")
            record.rung, record.exit = body.get("rung"), body.get("exit")
            record.deadline_met = bool(body.get("deadline_met", False))
            record.correct = body.get("label") == record.label
        return record


async def _open_loop(sender: _Sender, offsets: np.ndarray, done: Callable[[], None]) -> list[Record]:
    tasks = []

    async def one(i: int, t: float) -> Record:
        record = await sender.send(i, t)
        done()
        return record

    sender.start = time.perf_counter()
    for i, t in enumerate(offsets.tolist()):
        delay = sender.start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, t)))
    return list(await asyncio.gather(*tasks))


async def _single_stream(sender: _Sender, requests: int, duration_s: float, done: Callable[[], None]) -> list[Record]:
    records: list[Record] = []
    sender.start = time.perf_counter()
    while len(records) < requests and time.perf_counter() - sender.start < duration_s:
        records.append(await sender.send(len(records), None))
        done()
    return records


async def _run(config: LoadConfig, split: Split, progress: bool) -> list[Record]:
    if config.scenario is Scenario.SERVER:
        offsets = poisson_offsets(config.rate, config.requests, config.duration_s, arrival_rng(config.seed))
        n = len(offsets)
    else:
        offsets, n = np.zeros(0), config.requests
    workload = make_workload(n, len(split), config.deadlines, config.seed)
    pool = ConnectionPool(config.url, MAX_CONNECTIONS)
    requests = encode_requests(config, split, workload, pool)
    try:
        await _check_ready(pool, config)
        # Open a few connections before the clock starts, so the first requests do not pay for connecting.
        health = pool.request("GET", "/healthz")
        await asyncio.gather(*(pool.send(health, config.timeout_s) for _ in range(config.warm_connections)))
        sender = _Sender(pool, requests, workload, split, config.timeout_s)
        with tqdm(total=n, unit="req", desc=f"{config.scenario} {config.policy}", disable=not progress) as bar:
            if config.scenario is Scenario.SERVER:
                return await _open_loop(sender, offsets, lambda: bar.update())
            return await _single_stream(sender, n, config.duration_s, lambda: bar.update())
    finally:
        await pool.close()


async def _check_ready(pool: ConnectionPool, config: LoadConfig) -> None:
    try:
        response = await pool.send(pool.request("GET", "/readyz"), config.timeout_s)
    except (asyncio.TimeoutError, *TRANSPORT_ERRORS) as e:
        raise ConnectionError(f"no server answers at {config.url}: {type(e).__name__}") from None
    if response.status != 200:
        raise ConnectionError(f"the server at {config.url} is not ready (/readyz answered {response.status})")


def run_load(config: LoadConfig, split: Split, progress: bool = True) -> list[Record]:
    """Run the configured load against `config.url` (which must be checked with check_target first)."""
    if config.policy == "fixed" and not config.rung:
        raise ValueError("policy fixed needs a rung")
    # uvloop: less CPU taken from the server. No garbage collection while the clock runs: a collection of the
    # growing list of records paused the sender and the readers for milliseconds, which showed up as latency.
    gc.collect()
    gc.disable()
    try:
        return uvloop.run(_run(config, split, progress))
    finally:
        gc.enable()


def write_run(out: Path, config: LoadConfig, records: list[Record], **extra: Any) -> dict[str, Any]:
    """records.jsonl and summary.json (config, method and figures) in `out`; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "records.jsonl", records)
    summary = {"config": config.describe(), **extra, "metrics": summarize(records)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
