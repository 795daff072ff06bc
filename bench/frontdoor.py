"""The front door: what a request costs around the model, side by side with a plain server and the bare engine.

One run, one machine, every server started here on loopback under the same uvicorn flags (uvloop,
httptools, no access log):

1. Concurrency 1, one keep-alive connection (a blocking socket: the cheapest client, whose own cost is in
   every figure alike), interleaved rounds. For the fastest single INT8 rung and the most accurate single
   rung: the floor (a bare FastAPI constant endpoint), the plain baseline server (loadtest/baseline.py) on
   that rung's ONNX file, the lean reference on it (loadtest/baseline.py --lean: an async route, orjson, the
   engine inline; how little the request path can cost on this machine), the bare engine (same session options,
   in this process), and Anytime fixed on that rung with a JSON/base64 body, a binary PNG body and a uint8 tensor
   body. Then Anytime's default policy at a loose deadline and at 2 ms (20 requests, one after another on one
   keep-alive connection, on time = 200 within 2 ms at the client), and where Anytime's time goes (its
   Server-Timing phases).
2. Open-loop Poisson load on the fastest INT8 rung, both servers. Capacity: the highest rate whose answers
   keep up (>= 95 % answered 200 within a loose 100 ms deadline, at the client). Then a 5 ms deadline at
   25/50/70/100/200 % of Anytime's capacity: on time at the client (200 within 5 ms of sending), status
   codes, how fast refusals come back, and the server's error count (500s and tracebacks in its log). And
   the capacity at 5 ms: the highest rate with >= 99 % on time at the client. At 200 % also the refusal floor:
   a third server, Anytime with an API key the client lacks, refuses every request 401 in its HTTP parser (no
   body read, no work), so its client-side latency is what a refusal costs this machine and this load generator
   at that rate; Anytime's refusal p99 is printed as a ratio to it. Last, 70 % of capacity again from a client
   that keeps 32 keep-alive connections open (idle connections must not make the server shed).
3. The front-door issue's targets that these figures decide, each printed with this run's figure as met, MISSED or
   cannot tell (`targets`; also in frontdoor.json), so that a run grades itself the same way every time.

Before the servers start and after they stop, the machine's steadiness (loadtest/steadiness.py: how often a fixed
loop on one core ran at under half its usual speed, 5 s each), so that a reader can tell a run on a steady
machine from one on a machine that slows down in spells.

    python -m bench.frontdoor [--ladder ladders/default] [--requests 1000] [--trial-s 3] [--out reports/frontdoor]
"""

from __future__ import annotations

import argparse
import base64
import json
import secrets
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.factory import open_engine
from engines.manifest import Ladder, Rung, load_ladder
from loadtest.baseline import running_baseline
from loadtest.client import WARM_CONNECTIONS, LoadConfig, run_load
from loadtest.harness import png_base64, running_server
from loadtest.http import BlockingConnection, server_timing
from loadtest.schedule import DeadlineMix
from loadtest.steadiness import measure as measure_steadiness
from loadtest.summary import Record
from loadtest.sweep import find_capacity
from models.data import FashionMNIST, PreprocessSpec, Split

LOAD_LEVELS = (0.25, 0.5, 0.7, 1.0, 2.0)
STEADINESS_S = 5.0  # the steadiness probe before and after the run
SERVERS = ("anytime", "anytime-png", "plain")  # anytime-png: the same server, the PNG file as the body
LABELS = {"anytime": "Anytime, JSON/base64", "anytime-png": "Anytime, PNG body", "plain": "plain FastAPI + ORT, JSON"}
SCAN_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # for the capacity at 5 ms and the plot
CLIENT_TIMEOUT_S = 2.0
TIGHT_REQUESTS, TIGHT_DEADLINE_MS = 20, 2.0  # the 2 ms test on an idle server
POOL_CONNECTIONS = 32  # a client with a large keep-alive pool, at 70 % of capacity


def pick_rungs(ladder: Ladder) -> dict[str, Rung]:
    """The fastest single INT8 rung (batch-1 p50; the fastest FP32 one where the probe built no INT8) and the most
    accurate single rung (val), ONNX Runtime."""
    ort = [r for r in ladder.rungs if r.backend == "onnxruntime" and r.precision in ("int8", "fp32")]
    fastest = min([r for r in ort if r.precision == "int8"] or ort, key=lambda r: r.profile(1).p50_ms)
    best = max(ort, key=lambda r: (r.val_accuracy, -r.profile(1).p50_ms))
    return {"fastest INT8": fastest, "most accurate": best}


# -- concurrency 1 ------------------------------------------------------------------------------------------
@dataclass
class Series:
    """One client configuration: its requests and what came back."""

    label: str
    url: str
    requests: list[bytes]
    client_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    ok: list[bool] = field(default_factory=list)  # per request, beside client_ms: answered 200

    def run(self, n: int) -> None:
        conn = BlockingConnection(self.url)
        try:
            for i in range(n):
                request = self.requests[i % len(self.requests)]
                start = time.perf_counter()
                response, headers = conn.send(request)
                self.client_ms.append((time.perf_counter() - start) * 1e3)
                self.statuses[response.status] += 1
                self.ok.append(response.status == 200)
                body = response.json()
                if "latency_ms" in body:
                    self.server_ms.append(body["latency_ms"])
                if "server-timing" in headers:
                    self.phases.append(server_timing(headers["server-timing"]))
        finally:
            conn.close()

    def p(self, q: float, values: list[float] | None = None) -> float:
        return float(np.percentile(self.client_ms if values is None else values, q))


def json_requests(conn_url: str, pngs: list[str], **options: Any) -> list[bytes]:
    conn = BlockingConnection(conn_url)
    conn.close()
    return [conn.request("POST", "/v1/classify", json.dumps({"image": p, **options}).encode()) for p in pngs]


def binary_requests(url: str, bodies: list[bytes], media: str, **query: Any) -> list[bytes]:
    conn = BlockingConnection(url)
    conn.close()
    path = "/v1/classify?" + urllib.parse.urlencode(query)
    return [conn.request("POST", path, b, media) for b in bodies]


def engine_ms(ladder_dir: Path, rung: Rung, inputs: np.ndarray, runs: int, threads: int) -> list[float]:
    """The bare engine's batch-1 times (ms), with the thread count the servers give it (the ladder's)."""
    engine = open_engine(rung.backend, ladder_dir / rung.artifact.path, rung.precision, threads)
    for i in range(100):
        engine.run(inputs[i % len(inputs)][None])
    samples = []
    for i in range(runs):
        start = time.perf_counter()
        engine.run(inputs[i % len(inputs)][None])
        samples.append((time.perf_counter() - start) * 1e3)
    engine.close()
    return samples


def concurrency_one(
    ladder_dir: Path, ladder: Ladder, split: Split, urls: dict[str, str], requests: int, rounds: int
) -> dict[str, Any]:
    spec = PreprocessSpec.from_dict(ladder.preprocess)
    images = split.images[:200]
    pngs = [png_base64(im) for im in images]
    raw_pngs = [base64.b64decode(p) for p in pngs]
    inputs = spec.normalize(images)
    report: dict[str, Any] = {"rungs": {}}
    series: list[Series] = []
    per_rung: dict[str, dict[str, Series]] = {}
    for role, rung in pick_rungs(ladder).items():
        fixed = {"deadline_ms": 1000, "policy": "fixed", "rung": rung.name}
        s = {
            "floor": Series(
                "floor: bare FastAPI constant endpoint",
                urls["floor"],
                json_requests(urls["floor"], pngs, deadline_ms=1000),
            ),
            "plain": Series(
                "plain FastAPI + ONNX Runtime, JSON/base64",
                urls[f"plain:{rung.name}"],
                json_requests(urls[f"plain:{rung.name}"], pngs, deadline_ms=1000),
            ),
            "lean": Series(
                "lean reference: async, orjson, inline, JSON",
                urls[f"lean:{rung.name}"],
                json_requests(urls[f"lean:{rung.name}"], pngs, deadline_ms=1000),
            ),
            "json": Series(
                "Anytime fixed, JSON/base64", urls["anytime"], json_requests(urls["anytime"], pngs, **fixed)
            ),
            "png": Series(
                "Anytime fixed, binary PNG body",
                urls["anytime"],
                binary_requests(urls["anytime"], raw_pngs, "image/png", **fixed),
            ),
            "tensor": Series(
                "Anytime fixed, uint8 tensor body",
                urls["anytime"],
                binary_requests(
                    urls["anytime"],
                    [im.tobytes() for im in images],
                    "application/x-tensor",
                    dtype="uint8",
                    shape="28,28",
                    **fixed,
                ),
            ),
        }
        per_rung[role] = s
        series += s.values()
    default_loose = Series(
        "Anytime default policy, deadline 1000 ms",
        urls["anytime"],
        json_requests(urls["anytime"], pngs, deadline_ms=1000),
    )
    series.append(default_loose)
    for _ in range(rounds):  # interleaved: a slow spell of the machine hits every configuration alike
        for s in series:
            s.run(requests)
    runs = requests * rounds
    engines = {role: engine_ms(ladder_dir, r, inputs, runs, ladder.threads) for role, r in pick_rungs(ladder).items()}
    # Each a different image, one after another on one keep-alive connection: no other load
    tight = Series(
        "Anytime default policy, deadline 2 ms",
        urls["anytime"],
        json_requests(urls["anytime"], pngs[:TIGHT_REQUESTS], deadline_ms=TIGHT_DEADLINE_MS),
    )
    tight.run(TIGHT_REQUESTS)
    for role, rung in pick_rungs(ladder).items():
        s, eng = per_rung[role], float(np.median(engines[role]))
        report["rungs"][role] = {
            "rung": rung.name,
            "engine_p50_ms": eng,
            **{
                k: {
                    "label": v.label,
                    "p50_ms": v.p(50),
                    "p99_ms": v.p(99),
                    "statuses": dict(v.statuses),
                    "server_p50_ms": float(np.median(v.server_ms)) if v.server_ms else None,
                }
                for k, v in s.items()
            },
        }
    report["default_loose"] = {
        "p50_ms": default_loose.p(50),
        "server_p50_ms": float(np.median(default_loose.server_ms)),
    }
    report["default_2ms"] = {
        "statuses": dict(tight.statuses),
        "p50_ms": tight.p(50),
        "answered_200": int(tight.statuses[200]),  # on time by the server's clock
        "on_time": sum(ok and ms <= TIGHT_DEADLINE_MS for ms, ok in zip(tight.client_ms, tight.ok, strict=True)),
    }
    phases = per_rung["fastest INT8"]["json"].phases
    report["phases_ms"] = {k: float(np.median([p.get(k, 0.0) for p in phases])) for k in phases[0]} if phases else {}
    return report


def print_concurrency_one(r: dict[str, Any]) -> None:
    print("\n== Concurrency 1, one keep-alive connection (client p50 / p99 ms) ==")
    for role, d in r["rungs"].items():
        eng = d["engine_p50_ms"]
        print(f"\n{role} rung {d['rung']}: bare engine p50 {eng:.3f} ms")
        for key in ("floor", "plain", "lean", "json", "png", "tensor"):
            v = d[key]
            server = f"   server latency_ms p50 {v['server_p50_ms']:.3f}" if v["server_p50_ms"] is not None else ""
            print(
                f"  {v['label']:<44} {v['p50_ms']:7.3f} / {v['p99_ms']:7.3f}   "
                f"minus engine {v['p50_ms'] - eng:6.3f}{server}"
            )
        plain, any_json, any_png = d["plain"]["p50_ms"], d["json"]["p50_ms"], d["png"]["p50_ms"]
        lean = d["lean"]["p50_ms"]
        print(
            f"  ratios: Anytime JSON / plain {any_json / plain:.2f}x, Anytime PNG / plain {any_png / plain:.2f}x, "
            f"Anytime JSON / lean {any_json / lean:.2f}x; Anytime JSON - engine {any_json - eng:.3f} ms (target <= "
            f"0.5), plain - engine {plain - eng:.3f} ms, lean - engine {lean - eng:.3f} ms"
        )
    loose, tight = r["default_loose"], r["default_2ms"]
    print(
        f"\nAnytime default policy, deadline 1000 ms: client p50 {loose['p50_ms']:.3f} ms, server latency_ms p50 "
        f"{loose['server_p50_ms']:.3f} ms, client - server {loose['p50_ms'] - loose['server_p50_ms']:.3f} ms"
    )
    print(
        f"Anytime default policy, deadline 2 ms on an idle server (one keep-alive connection): {tight['on_time']} of "
        f"{TIGHT_REQUESTS} answered 200 within 2 ms at the client ({_answered_200(tight)} of {TIGHT_REQUESTS} on time "
        f"by the server's clock; statuses {tight['statuses']}), client p50 {tight['p50_ms']:.3f} ms"
    )
    ph = r["phases_ms"]
    if ph:
        print("\nWhere Anytime's time goes (fastest rung, JSON; median Server-Timing phases, ms):")
        print("  " + "  ".join(f"{k} {v:.3f}" for k, v in ph.items()))
        client = r["rungs"]["fastest INT8"]["json"]["p50_ms"]
        print(
            f"  client p50 {client:.3f} - app {ph.get('app', 0):.3f} = {client - ph.get('app', 0):.3f} ms outside the "
            "app (HTTP parsing, sockets, the client itself)"
        )


# -- open loop ----------------------------------------------------------------------------------------------
@dataclass
class Trial:
    server: str
    rate: float
    deadline_ms: float
    records: list[Record]

    @property
    def sent(self) -> int:
        return len(self.records)

    def share(self, pred: Callable[[Record], bool]) -> float:
        return sum(pred(r) for r in self.records) / self.sent if self.sent else 0.0

    def on_time(self, within_ms: float) -> float:
        return self.share(lambda r: r.status == 200 and r.client_ms <= within_ms)

    def achieved_rate(self) -> float:
        span = max(r.send_s for r in self.records) - min(r.send_s for r in self.records)
        return (self.sent - 1) / span if span > 0 else 0.0

    def statuses(self) -> Counter[str]:
        """Answers by status and code, e.g. "503 overloaded"; no answer: the client's code (client_timeout)."""
        return Counter(f"{r.status} {r.code}" if r.status else r.code for r in self.records)

    def refusal_p99(self, reused_only: bool = False) -> float | None:
        """Refused before any work (429, 503); a 504 is work admitted that could not finish in time. With
        `reused_only`, only refusals on a connection the load generator already had open: a request that opens
        one waits for the server to accept it, which takes several rounds of a busy event loop."""
        refused = [
            r.client_ms for r in self.records if r.status in (429, 503) and not (reused_only and r.new_connection)
        ]
        return float(np.percentile(refused, 99)) if refused else None

    def new_connections(self) -> int:
        return sum(r.new_connection for r in self.records)

    def client_ms(self, status: int, q: float) -> float | None:
        """The q-th percentile of the client latency of the answers with this status; None if there are none."""
        ms = [r.client_ms for r in self.records if r.status == status]
        return float(np.percentile(ms, q)) if ms else None


class Loader:
    def __init__(self, urls: dict[str, str], rung: str, split: Split, trial_s: float) -> None:
        self.urls, self.rung, self.split, self.trial_s = urls, rung, split, trial_s
        self.trials: list[Trial] = []

    def run(self, server: str, rate: float, deadline_ms: float, warm_connections: int = WARM_CONNECTIONS) -> Trial:
        config = LoadConfig(
            url=self.urls[server.removesuffix("-png")],
            body="png" if server.endswith("-png") else "json",
            rate=rate,
            requests=int(rate * self.trial_s) + 1,
            duration_s=self.trial_s,
            deadlines=DeadlineMix.single(deadline_ms),
            policy="fixed",
            rung=self.rung,
            timeout_s=CLIENT_TIMEOUT_S,
            seed=len(self.trials),
            warm_connections=warm_connections,
        )
        trial = Trial(server, rate, deadline_ms, run_load(config, self.split, progress=False))
        self.trials.append(trial)
        time.sleep(0.5)  # let the server settle between trials
        return trial


def capacity(loader: Loader, server: str, start: float) -> tuple[float | None, float | None]:
    """Keep-up capacity: the highest rate with >= 95 % answered 200 within a loose 100 ms deadline."""
    return find_capacity(lambda rate: loader.run(server, rate, 100.0).on_time(100.0) >= 0.95, start, 8, 4)


def capacity_at_5ms(scan: list[tuple[float, float]]) -> float | None:
    """The highest scanned rate up to which every scanned rate had >= 99 % on time at 5 ms (rate, share)."""
    best = None
    for rate, share in sorted(scan):
        if share < 0.99:
            break
        best = rate
    return best


def log_errors(path: Path) -> dict[str, int]:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return {
        "tracebacks": text.count("Traceback"),
        "error_lines": sum(" ERROR " in line or line.startswith("ERROR") for line in text.splitlines()),
    }


def open_loop(urls: dict[str, str], rung: str, split: Split, trial_s: float, logs: dict[str, Path]) -> dict[str, Any]:
    loader = Loader(urls, rung, split, trial_s)
    out: dict[str, Any] = {"rung": rung, "capacity": {}, "levels": [], "scan": {s: [] for s in SERVERS}}
    for server in SERVERS:
        out["capacity"][server] = capacity(loader, server, 400.0)
    cap = out["capacity"]["anytime"][0] or 100.0
    fractions = sorted({*LOAD_LEVELS, *SCAN_LEVELS})
    for fraction in fractions:
        for server in SERVERS:
            t = loader.run(server, cap * fraction, 5.0)
            out["scan"][server].append((t.rate, t.on_time(5.0)))
            if fraction in LOAD_LEVELS:
                out["levels"].append(
                    {
                        "level": fraction,
                        "server": server,
                        "rate": t.rate,
                        "achieved_rate": t.achieved_rate(),
                        "sent": t.sent,
                        "on_time_5ms": t.on_time(5.0),
                        "statuses": dict(t.statuses()),
                        "refusal_p99_ms": t.refusal_p99(),
                        "refusal_p99_reused_ms": t.refusal_p99(reused_only=True),
                        "new_connections": t.new_connections(),
                        "server_500s": sum(r.status == 500 for r in t.records),
                    }
                )
    t = loader.run("refusing", cap * max(LOAD_LEVELS), 5.0)
    out["refusal_floor"] = {
        "rate": t.rate,
        "sent": t.sent,
        "statuses": dict(t.statuses()),
        "p50_ms": t.client_ms(401, 50),
        "p99_ms": t.client_ms(401, 99),
    }
    out["capacity_5ms"] = {server: capacity_at_5ms(out["scan"][server]) for server in SERVERS}
    # A client that keeps a large pool of keep-alive connections open, as proxies and HTTP libraries do: idle
    # connections hold no work, so they must not make the server shed at 70 % of capacity.
    t = loader.run("anytime", cap * 0.7, 5.0, warm_connections=POOL_CONNECTIONS)
    out["pool"] = {
        "connections": POOL_CONNECTIONS,
        "rate": t.rate,
        "on_time_5ms": t.on_time(5.0),
        "statuses": dict(t.statuses()),
    }
    return out


def plot_scan(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for server, style in zip(SERVERS, ("o-", "^-", "s--"), strict=True):
        rates, shares = zip(*sorted(r["scan"][server]), strict=True)
        ax.plot(rates, [100 * s for s in shares], style, label=LABELS[server])
    ax.axhline(99, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("offered load, Poisson requests/s")
    ax.set_ylabel("answered 200 within 5 ms at the client, %")
    ax.set_title(f"Open-loop load, rung {r['rung']}, 5 ms deadline")
    ax.set_ylim(0, 101)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_open_loop(r: dict[str, Any]) -> None:
    print(f"\n== Open-loop Poisson load, rung {r['rung']} (fixed), client timeout {CLIENT_TIMEOUT_S:g} s ==")
    caps = {server: r["capacity"][server][0] or 0.0 for server in SERVERS}
    print(
        "capacity (>= 95 % answered 200 within 100 ms at the client): "
        + ", ".join(f"{LABELS[s]} {caps[s]:.0f} req/s" for s in SERVERS)
        + (f"; Anytime JSON / plain {caps['anytime'] / caps['plain']:.2f}x" if caps["plain"] else "")
    )
    print(f"\n5 ms deadline at fractions of Anytime's (JSON) capacity ({caps['anytime']:.0f} req/s):")
    print(
        f"  {'load':>5} {'server':<12} {'rate':>7} {'achieved':>8} {'sent':>6} {'on time':>8}  "
        f"{'refusal p99':>11} {'(reused)':>9} {'new conns':>9}  statuses"
    )
    for row in r["levels"]:
        ref = f"{row['refusal_p99_ms']:.2f} ms" if row["refusal_p99_ms"] is not None else "-"
        reused = f"{row['refusal_p99_reused_ms']:.2f} ms" if row["refusal_p99_reused_ms"] is not None else "-"
        print(
            f"  {row['level']:>5.0%} {row['server']:<12} {row['rate']:>7.0f} {row['achieved_rate']:>8.0f} "
            f"{row['sent']:>6} "
            f"{row['on_time_5ms']:>8.2%}  {ref:>11} {reused:>9} {row['new_connections']:>9}  {row['statuses']}"
        )
    floor = r["refusal_floor"]
    if floor["p99_ms"] is not None:
        print(
            f"  refusal floor at {floor['rate']:.0f} req/s (Anytime refusing every request 401 in its HTTP parser, "
            f"no work): client p50 {floor['p50_ms']:.2f} ms, p99 {floor['p99_ms']:.2f} ms ({floor['statuses']})"
        )
        top = [row for row in r["levels"] if row["level"] == max(LOAD_LEVELS) and row["refusal_p99_ms"] is not None]
        if top:
            print(
                "  refusal p99 / the floor's at that rate: "
                + ", ".join(f"{LABELS[row['server']]} {row['refusal_p99_ms'] / floor['p99_ms']:.2f}x" for row in top)
            )
    pool = r["pool"]
    print(
        f"  70 %, Anytime JSON, the client keeping {pool['connections']} connections open from the start: "
        f"{pool['on_time_5ms']:.2%} on time, {pool['statuses']}"
    )
    c5 = {server: r["capacity_5ms"][server] or 0.0 for server in SERVERS}
    print(
        "\ncapacity at 5 ms (highest scanned rate up to which every rate had >= 99 % answered 200 within 5 ms at "
        "the client): " + ", ".join(f"{LABELS[s]} {c5[s]:.0f} req/s" for s in SERVERS)
    )
    if c5["plain"]:
        print(
            f"  ratios to plain (target >= 1.5x): Anytime JSON {c5['anytime'] / c5['plain']:.2f}x, Anytime PNG body "
            f"{c5['anytime-png'] / c5['plain']:.2f}x"
        )
    print("on time at 5 ms by offered rate, req/s: " + " / ".join(LABELS[s] for s in SERVERS))
    for point in zip(*(r["scan"][s] for s in SERVERS), strict=True):
        print(f"  {point[0][0]:6.0f}: " + " / ".join(f"{share:6.1%}" for _, share in point))
    for server, errors in r["log_errors"].items():
        print(f"server log of {server}: {errors['tracebacks']} tracebacks, {errors['error_lines']} ERROR lines")


# -- the targets --------------------------------------------------------------------------------------
REFUSED_WITH_JSON = frozenset({"429", "503", "504"})  # statuses a refusal may carry


@dataclass
class Target:
    target: str
    figure: str
    met: bool | None  # None: this run cannot tell (say why in `figure`)


def targets(report: dict[str, Any]) -> list[Target]:
    """Each of the front-door issue's targets that this benchmark measures, with this run's figure and whether it held.

    Not graded here: the tight-deadline test on three fresh clones (a test, not a benchmark). "Every request answered
    200 or refused with JSON" counts answers by status and code: a 429/503/504 must carry a JSON body with a `code`
    (no answer at all is recorded as `client_timeout` or `transport_error`)."""
    out: list[Target] = []
    c1 = report["concurrency_1"]
    for role, d in c1["rungs"].items():
        eng, plain = d["engine_p50_ms"], d["plain"]["p50_ms"]
        for key, body in (("json", "JSON/base64"), ("png", "PNG body")):
            ms = d[key]["p50_ms"]
            out.append(
                Target(
                    f"concurrency 1, {role} rung, {body}: client p50 - bare engine <= 0.5 ms",
                    f"{ms - eng:.3f} ms (lean reference {d['lean']['p50_ms'] - eng:.3f})",
                    ms - eng <= 0.5,
                )
            )
            out.append(
                Target(
                    f"concurrency 1, {role} rung, {body}: client p50 below plain FastAPI + ORT's",
                    f"{ms / plain:.2f}x plain",
                    ms < plain,
                )
            )
    tight = c1["default_2ms"]
    out.append(
        Target(
            "default policy, 2 ms deadline, idle server: >= 19 of 20 on time at the client",
            f"{tight['on_time']} of {TIGHT_REQUESTS} ({_answered_200(tight)} on time by the server's clock)",
            tight["on_time"] >= 19,
        )
    )
    loop = report.get("open_loop")
    if loop is None:
        return out
    levels = {(row["level"], row["server"]): row for row in loop["levels"]}
    floor = loop.get("refusal_floor", {}).get("p99_ms")  # reports from before the refusal floor lack it
    for server in ("anytime", "anytime-png"):
        for level in (0.25, 0.5, 0.7):
            share = levels[(level, server)]["on_time_5ms"]
            out.append(
                Target(
                    f"{LABELS[server]}, {level:.0%} of capacity: >= 99 % on time at 5 ms", f"{share:.2%}", share >= 0.99
                )
            )
        mine, plain_c5 = loop["capacity_5ms"][server], loop["capacity_5ms"]["plain"]
        lowest = min(rate for rate, _ in loop["scan"][server]) if loop["scan"][server] else 0.0
        if plain_c5:
            ratio, met = f"{(mine or 0.0) / plain_c5:.2f}x plain", (mine or 0.0) >= 1.5 * plain_c5
        elif mine:  # plain had < 99 % even at the lowest rate scanned: its capacity is below that rate, how far below
            # is not known, so only a capacity of 1.5x that rate or more decides
            ratio, met = f"{mine:.0f} req/s, plain under {lowest:.0f}", True if mine >= 1.5 * lowest else None
        else:
            ratio, met = f"neither reached 99 % at the lowest rate scanned ({lowest:.0f} req/s)", None
        out.append(Target(f"{LABELS[server]}: capacity at 5 ms >= 1.5x plain's", ratio, met))
        top = levels[(max(LOAD_LEVELS), server)]
        answered = all(_answered_with_json(key) for key in top["statuses"])
        out.append(
            Target(
                f"{LABELS[server]}, 2x capacity: every request 200 or refused 429/503/504 with JSON, no 500",
                str(top["statuses"]),
                answered and top["server_500s"] == 0,
            )
        )
        p99 = top["refusal_p99_ms"]
        context = f" (the refusal floor's {floor:.2f} ms)" if floor is not None else ""
        out.append(
            Target(
                f"{LABELS[server]}, 2x capacity: refusal p99 < 2 ms",
                f"{p99:.2f} ms{context}" if p99 is not None else "no refusals",
                p99 is None or p99 < 2.0,
            )
        )
    errors = loop.get("log_errors", {}).get("anytime")
    if errors is not None:
        out.append(
            Target(
                "Anytime's log: no traceback",
                f"{errors['tracebacks']} tracebacks, {errors['error_lines']} ERROR lines",
                errors["tracebacks"] == 0,
            )
        )
    return out


def _answered_200(tight: dict[str, Any]) -> int:
    """The 2 ms test's answers 200 (on time by the server's clock; reports before `58c2fc6` counted only these, as
    `on_time`)."""
    return int(tight.get("answered_200", tight["on_time"]))


def _answered_with_json(status_and_code: str) -> bool:
    """An answer 200, or a refusal 429/503/504 whose JSON body had a `code` (Trial.statuses' keys)."""
    status, _, code = status_and_code.partition(" ")
    if status == "200":
        return code == "ok"
    # loadtest/client.py records a body that is not a JSON object as `bad_body`, one without a `code` as `http_<status>`
    return status in REFUSED_WITH_JSON and code not in ("", "bad_body", f"http_{status}")


def print_targets(rows: list[Target]) -> None:
    print("\n== The front-door issue's targets, this run ==")
    for t in rows:
        verdict = {True: "met", False: "MISSED", None: "cannot tell"}[t.met]
        print(f"  {verdict:<11} {t.target}: {t.figure}")


@contextmanager
def servers(
    ladder_dir: Path, ladder: Ladder, out: Path, refusing: bool = True
) -> Iterator[tuple[dict[str, str], dict[str, Path]]]:
    logs = {"anytime": out / "anytime.log", "plain": out / "plain.log"}
    with ExitStack() as stack:
        urls = {"anytime": stack.enter_context(running_server(ladder_dir, log=logs["anytime"]))}
        if refusing:  # the refusal floor: the same server with an API key the load generator does not send
            logs["refusing"] = out / "refusing.log"
            refuse = running_server(ladder_dir, log=logs["refusing"], ANYTIME_API_KEY=secrets.token_hex(16))
            urls["refusing"] = stack.enter_context(refuse)
        urls["floor"] = stack.enter_context(running_baseline(ladder_dir, floor=True))
        for i, rung in enumerate(pick_rungs(ladder).values()):
            log = logs["plain"] if i == 0 else out / f"plain-{rung.name}.log"
            urls[f"plain:{rung.name}"] = stack.enter_context(running_baseline(ladder_dir, rung.name, log=log))
            urls[f"lean:{rung.name}"] = stack.enter_context(running_baseline(ladder_dir, rung.name, lean=True))
        urls["plain"] = urls[f"plain:{pick_rungs(ladder)['fastest INT8'].name}"]
        yield urls, logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--requests", type=int, default=1000, help="requests per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trial-s", type=float, default=3.0, help="seconds of open-loop load per trial")
    parser.add_argument("--skip-load", action="store_true", help="concurrency 1 only")
    parser.add_argument("--out", type=Path, default=Path("reports/frontdoor"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ladder = load_ladder(args.ladder)
    split = FashionMNIST().split("test")
    started = time.perf_counter()
    before = measure_steadiness(STEADINESS_S)
    print(f"machine steadiness before the run: {before.describe()}")
    report: dict[str, Any] = {"steadiness": {"before": before.plain()}}
    with servers(args.ladder, ladder, args.out, refusing=not args.skip_load) as (urls, logs):
        report["concurrency_1"] = concurrency_one(args.ladder, ladder, split, urls, args.requests, args.rounds)
        print_concurrency_one(report["concurrency_1"])
        if not args.skip_load:
            rung = pick_rungs(ladder)["fastest INT8"].name
            report["open_loop"] = open_loop(urls, rung, split, args.trial_s, logs)
    if "open_loop" in report:
        report["open_loop"]["log_errors"] = {server: log_errors(path) for server, path in logs.items()}
        print_open_loop(report["open_loop"])
        plot_scan(report["open_loop"], args.out / "frontdoor-load.png")
        print(f"wrote {args.out / 'frontdoor-load.png'}")
    after = measure_steadiness(STEADINESS_S)
    report["steadiness"]["after"] = after.plain()
    print(f"\nmachine steadiness after the run: {after.describe()}")
    rows = targets(report)
    print_targets(rows)
    report["targets"] = [asdict(t) for t in rows]
    report["wall_s"] = time.perf_counter() - started
    (args.out / "frontdoor.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'frontdoor.json'} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
