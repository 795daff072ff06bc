"""Cores kept awake (service/awake.py) or left to sleep: a lone request's cost on a quiet server, side by side.

One run, one machine. Anytime (fixed on the fastest single INT8 rung, JSON/base64 bodies) and the plain
baseline server (loadtest/baseline.py) on the same ONNX file, each its own process on loopback under the same
uvicorn flags; the bare engine in this process. The spinners are the ones `ANYTIME_KEEP_CORES_AWAKE=true`
starts (one per core, SCHED_IDLE); they keep the cores of the whole machine awake, so both servers and the bare
engine run with them ("on") and without ("off"), the two alternating round by round, so that a slow spell of
the machine hits both alike.

1. Concurrency 1, one keep-alive connection per server (a blocking socket), with 0, 2, 5 and 20 ms of idle time
   before each request: client p50 / p90 / p99, and the bare engine's run after the same pauses.
2. Anytime's default policy with 1 and 2 ms deadlines, one request every 20 ms (a quiet server): on time at
   the client (200 within the deadline of sending).
3. Open-loop Poisson load with 5 ms deadlines at 600 and 1700 req/s (about 25 % and 70 % of Anytime's
   keep-up capacity on this machine): on time at the client and the client p50.

    python -m bench.awake [--ladder ladders/default] [--rounds 16] [--out reports/awake.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bench.frontdoor import Loader, json_requests, pick_rungs
from engines.factory import open_engine
from engines.manifest import load_ladder
from loadtest.baseline import running_baseline
from loadtest.harness import png_base64, running_server
from loadtest.http import BlockingConnection
from models.data import FashionMNIST, PreprocessSpec
from service.awake import CoresAwake, supported

GAPS_MS = (0.0, 2.0, 5.0, 20.0)
PER_GAP = 10  # requests per gap, server and round
TIGHT_MS = (1.0, 2.0)
QUIET_GAP_MS = 20.0
RATES = (600.0, 1700.0)
LOAD_TRIALS = 3
T = TypeVar("T")


def alternating(awake: CoresAwake, rounds: int) -> Iterator[str]:
    """Yields "off" and "on" in alternating order, the spinners running during every "on"."""
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if mode == "on":
                awake.start()
            time.sleep(0.3)  # the spinners' start (or the cores' first sleep) is not measured
            try:
                yield mode
            finally:
                awake.stop()


def after_idle(gap_ms: float, call: Callable[[], T]) -> tuple[T, float]:
    """Sleep `gap_ms`, then call: what it returned, and how long it took (ms)."""
    time.sleep(gap_ms / 1e3)
    start = time.perf_counter()
    result = call()
    return result, (time.perf_counter() - start) * 1e3


def pct(values: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("reports/awake.json"))
    args = parser.parse_args()
    if not supported():
        raise SystemExit("keeping cores awake needs Linux's SCHED_IDLE")
    ladder = load_ladder(args.ladder)
    rung = pick_rungs(ladder)["fastest INT8"]
    split = FashionMNIST().split("test")
    images = split.images[:50]
    pngs = [png_base64(im) for im in images]
    inputs = PreprocessSpec.from_dict(ladder.preprocess).normalize(images)
    awake = CoresAwake()
    started = time.perf_counter()
    client: dict[tuple[str, float, str], list[float]] = defaultdict(list)
    tight: dict[tuple[float, str], list[bool]] = defaultdict(list)
    load: list[dict[str, Any]] = []
    with running_server(args.ladder) as anytime, running_baseline(args.ladder, rung.name) as plain:
        fixed = {"deadline_ms": 1000, "policy": "fixed", "rung": rung.name}
        requests = {
            "anytime": json_requests(anytime, pngs, **fixed),
            "plain": json_requests(plain, pngs, deadline_ms=1000),
        }
        conns = {"anytime": BlockingConnection(anytime), "plain": BlockingConnection(plain)}
        engine = open_engine(rung.backend, args.ladder / rung.artifact.path, rung.precision, ladder.threads)
        for i in range(200):  # warm-up
            for name, conn in conns.items():
                conn.send(requests[name][i % len(pngs)])
            engine.run(inputs[i % len(inputs)][None])
        tight_requests = {d: json_requests(anytime, pngs, deadline_ms=d) for d in TIGHT_MS}
        for mode in alternating(awake, args.rounds):
            for gap in GAPS_MS:
                for name, conn in conns.items():
                    for k in range(PER_GAP):
                        _, ms = after_idle(gap, partial(conn.send, requests[name][k]))
                        client[(name, gap, mode)].append(ms)
                for k in range(PER_GAP):
                    _, ms = after_idle(gap, partial(engine.run, inputs[k][None]))
                    client[("engine", gap, mode)].append(ms)
            for d in TIGHT_MS:
                for k in range(PER_GAP):
                    (response, _), ms = after_idle(QUIET_GAP_MS, partial(conns["anytime"].send, tight_requests[d][k]))
                    tight[(d, mode)].append(response.status == 200 and ms <= d)
        engine.close()
        for conn in conns.values():
            conn.close()
        loader = Loader({"anytime": anytime}, rung.name, split, 3.0)
        for rate in RATES:
            for mode in alternating(awake, LOAD_TRIALS):
                t = loader.run("anytime", rate, 5.0)
                load.append(
                    {
                        "rate": rate,
                        "mode": mode,
                        "on_time_5ms": t.on_time(5.0),
                        "client_p50_ms": float(np.median([r.client_ms for r in t.records])),
                        "statuses": dict(t.statuses()),
                    }
                )
    report: dict[str, Any] = {
        "rung": rung.name,
        "cores": awake.cores,
        "concurrency_1": [
            {"what": name, "gap_ms": gap, "mode": mode, **pct(v)} for (name, gap, mode), v in sorted(client.items())
        ],
        "quiet_default_policy": [
            {"deadline_ms": d, "mode": mode, "on_time": sum(v), "sent": len(v)}
            for (d, mode), v in sorted(tight.items())
        ],
        "load": load,
        "wall_s": time.perf_counter() - started,
    }
    print(f"rung {rung.name}; spinners on cores {awake.cores}; {args.rounds} rounds, each mode in turn")
    print("\nconcurrency 1, client p50 / p90 / p99 ms (bare engine: its run), cores asleep -> kept awake:")
    for name in ("anytime", "plain", "engine"):
        for gap in GAPS_MS:
            off, on = pct(client[(name, gap, "off")]), pct(client[(name, gap, "on")])
            print(
                f"  {name:8s} {gap:4.0f} ms idle before: {off['p50']:.3f} / {off['p90']:.3f} / {off['p99']:.3f}"
                f" -> {on['p50']:.3f} / {on['p90']:.3f} / {on['p99']:.3f}  (p50 {on['p50'] / off['p50']:.2f}x)"
            )
    for gap in GAPS_MS:
        a = {m: pct(client[("anytime", gap, m)])["p50"] for m in ("off", "on")}
        p = {m: pct(client[("plain", gap, m)])["p50"] for m in ("off", "on")}
        ratios = f"{a['off'] / p['off']:.2f}x asleep, {a['on'] / p['on']:.2f}x awake"
        print(f"  Anytime / plain p50 at {gap:.0f} ms idle: {ratios}")
    print(f"\ndefault policy, one request every {QUIET_GAP_MS:.0f} ms, on time at the client:")
    for d in TIGHT_MS:
        off, on = tight[(d, "off")], tight[(d, "on")]
        print(f"  {d:.0f} ms deadline: {sum(off)}/{len(off)} asleep, {sum(on)}/{len(on)} awake")
    print("\nopen-loop Poisson load, 5 ms deadlines (on time at the client, client p50):")
    for rate in RATES:
        for mode in ("off", "on"):
            rows = [x for x in load if x["rate"] == rate and x["mode"] == mode]
            print(
                f"  {rate:5.0f} req/s {'asleep' if mode == 'off' else 'awake '}: "
                + ", ".join(f"{x['on_time_5ms']:.2%} {x['client_p50_ms']:.3f} ms" for x in rows)
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
