"""Soak (a script, not CI): open-loop load at a share of the measured capacity for many minutes, mixed deadlines,
and beside it a steady stream of bad inputs and clients that leave; reports the server's memory (RSS) over time,
attainment, status codes, 500s and tracebacks.

    .venv/bin/python -m bench.soak --minutes 30          # the issue's soak: 30 min at 70 % of capacity
    .venv/bin/python -m bench.soak --minutes 3 --capacity 1500   # a short one at a known capacity

Capacity is the keep-up capacity of the default policy (loadtest/sweep.py: the highest rate at which >= 95 %
of requests are answered 200 within 100 ms at the client), measured first unless given. The server's RSS is
its own `process_resident_memory_bytes` metric, sampled every 5 s; growth is the mean of the last minute over
the mean of the first minute after warm-up (the second minute). Writes soak.json and soak.png under --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.client import LoadConfig, run_load
from loadtest.harness import running_server
from loadtest.results import PolicySpec, SweepConfig
from loadtest.schedule import DeadlineMix
from loadtest.summary import summarize
from loadtest.sweep import _Runner, keep_up_capacity
from models.data import FashionMNIST, Split

BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("image/png", b"\x89PNG\r\n\x1a\n not really", "/v1/classify?deadline_ms=50"),
    ("application/json", b'{"image": "###", "deadline_ms": 50}', "/v1/classify"),
    ("application/json", b'{"image": ', "/v1/classify"),
    ("application/json", b'{"image": [[1, 2], [3]], "deadline_ms": 5}', "/v1/classify"),
    ("text/plain", b"hello", "/v1/classify?deadline_ms=50"),
    ("application/x-tensor", b"\x00" * 100, "/v1/classify?deadline_ms=50&dtype=uint8&shape=28,28"),
    ("application/json", b'{"images": [], "deadline_ms": 50}', "/v1/classify/batch"),
    ("application/json", b'{"image": "AAAA", "deadline_ms": -3}', "/v1/classify"),
]


def _rss_mb(client: httpx.Client) -> float | None:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1]) / 2**20
    return None


class Sampler(threading.Thread):
    """The server's RSS every `every_s` seconds, with the time since the start."""

    def __init__(self, url: str, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s, self.samples, self.stop = url, every_s, [], threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        start = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.is_set():
                rss = _rss_mb(client)
                if rss is not None:
                    self.samples.append((time.monotonic() - start, rss))
                self.stop.wait(self.every_s)


class Mischief(threading.Thread):
    """Bad bodies and clients that leave mid-body or mid-answer, `rate` a second; counts the statuses seen."""

    def __init__(self, url: str, rate: float, images: np.ndarray) -> None:
        super().__init__(daemon=True)
        self.url, self.gap, self.images = url, 1.0 / rate, images
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.stop = threading.Event()
        self.statuses: collections.Counter[str] = collections.Counter()

    def _leave(self, kind: int) -> None:
        with socket.create_connection((self.host, self.port), timeout=5) as sock:
            if kind == 0:  # mid-body
                sock.sendall(b"POST /v1/classify?deadline_ms=50 HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n")
                sock.sendall(b"content-length: 5000\r\n\r\n" + b"\x89PNG" * 10)
            else:  # after a whole request, before its answer
                body = np.repeat(self.images[:1], 64, axis=0).tobytes()
                head = "POST /v1/classify/batch?deadline_ms=5000&dtype=uint8&shape=64,28,28 HTTP/1.1\r\n"
                head += f"host: x\r\ncontent-type: application/x-tensor\r\ncontent-length: {len(body)}\r\n\r\n"
                sock.sendall(head.encode() + body)
        self.statuses[f"left:{'mid-body' if kind == 0 else 'before-answer'}"] += 1

    def run(self) -> None:
        rng = random.Random(0)
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.wait(self.gap):
                try:
                    if rng.random() < 0.25:
                        self._leave(rng.randrange(2))
                        continue
                    media, body, path = rng.choice(BAD_BODIES)
                    r = client.post(path, content=body, headers={"content-type": media})
                    self.statuses[str(r.status_code)] += 1
                except (httpx.HTTPError, OSError) as e:
                    self.statuses[f"client error: {type(e).__name__}"] += 1


def measure_capacity(url: str, split: Split, out: Path) -> float:
    config = SweepConfig(ladder=Path("."), out=out, requests=3000, duration_s=3.0, progress=False)
    capacity = keep_up_capacity(_Runner(config, split, {"anytime": url}), PolicySpec("auto", "auto"), 200.0)
    if capacity.rate is None:
        raise SystemExit("no rate kept up: is the server working?")
    return capacity.rate


def soak(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "server.log"
    split = FashionMNIST().split("test")
    with running_server(args.ladder, log=log) as url:
        capacity = args.capacity or measure_capacity(url, split, args.out)
        rate = args.share * capacity
        print(f"capacity {capacity:.0f} req/s; soaking at {rate:.0f} req/s for {args.minutes} min")
        sampler, mischief = Sampler(url), Mischief(url, args.bad_rate, split.images[:64])
        sampler.start()
        mischief.start()
        minutes: list[dict[str, Any]] = []
        try:
            for minute in range(int(args.minutes)):
                load = LoadConfig(
                    url=url,
                    rate=rate,
                    requests=int(rate * 70),
                    duration_s=60.0,
                    deadlines=DeadlineMix.parse(args.deadlines),
                    policy="auto",
                    seed=minute,
                )
                records = run_load(load, split, progress=False)
                m = summarize(records)
                rss = [r for t, r in sampler.samples if minute * 60 <= t - sampler.samples[0][0] < (minute + 1) * 60]
                minutes.append(
                    {
                        "minute": minute + 1,
                        "sent": m["sent"],
                        "attainment_client": m["attainment_client"],
                        "statuses": dict(collections.Counter(str(r.status) for r in records)),
                        "codes": dict(collections.Counter(r.code for r in records)),
                        "rss_mb": float(np.mean(rss)) if rss else None,
                    }
                )
                print(json.dumps(minutes[-1]))
        finally:
            mischief.stop.set()
            sampler.stop.set()
            mischief.join()
            sampler.join()
    text = log.read_text(errors="replace")
    rss_by_minute = [m["rss_mb"] for m in minutes if m["rss_mb"] is not None]
    growth = (rss_by_minute[-1] / rss_by_minute[1] - 1) if len(rss_by_minute) >= 3 else None
    statuses: collections.Counter[str] = collections.Counter()
    for m in minutes:
        statuses.update({str(k): v for k, v in m["statuses"].items()})
    result = {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "minutes": minutes,
        "load_statuses": dict(statuses),
        "bad_input_statuses": dict(mischief.statuses),
        "responses_500": statuses.get("500", 0) + mischief.statuses.get("500", 0),
        "tracebacks_in_log": text.count("Traceback"),
        "rss_growth_after_warmup": growth,
        "rss_samples": sampler.samples,
    }
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    _plot(sampler.samples, minutes, args.out / "soak.png")
    return result


def _plot(samples: list[tuple[float, float]], minutes: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot([t / 60 for t, _ in samples], [r for _, r in samples])
    ax1.set_ylabel("server RSS (MiB)")
    ax2.plot([m["minute"] - 0.5 for m in minutes], [100 * (m["attainment_client"] or 0) for m in minutes], "o-")
    ax2.set_ylabel("on time at the client (%)")
    ax2.set_xlabel("minutes")
    fig.suptitle("soak: open-loop load, mixed deadlines, bad inputs and disconnects")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    p.add_argument("--minutes", type=int, default=30)
    p.add_argument("--share", type=float, default=0.7, help="of the measured capacity (default: %(default)s)")
    p.add_argument("--capacity", type=float, help="req/s (default: measured first)")
    p.add_argument("--deadlines", default="2:0.2,5:0.3,10:0.3,50:0.2", help="deadline_ms:share,...")
    p.add_argument("--bad-rate", type=float, default=10.0, help="bad requests and departures a second")
    p.add_argument("--out", type=Path, default=Path("reports/soak"))
    result = soak(p.parse_args())
    print(
        f"500s: {result['responses_500']}, tracebacks: {result['tracebacks_in_log']}, RSS growth after warm-up: "
        f"{result['rss_growth_after_warmup']}, load statuses {result['load_statuses']}, "
        f"bad inputs {result['bad_input_statuses']}"
    )


if __name__ == "__main__":
    main()
