"""Server overhead benchmark.

1. HTTP end-to-end p50 (client-measured, one reused connection, concurrency 1, fixed rung, loose deadline)
   minus the raw engine p50 of the same rung at batch 1, measured in this process in the same run.
2. The planner's own time per request: `Planner.plan` + `Scheduler.wait_ms` on the loaded ladder, timed
   in a loop (median of per-call times).

    python -m bench.service [--ladder ladders/default] [--requests 500] [--rung exit3.int8.onnxruntime]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import numpy as np

from engines.factory import open_engine
from engines.manifest import load_ladder
from loadtest.harness import png_base64, running_server
from models.data import FashionMNIST
from service.config import Settings
from service.metrics import Metrics
from service.planner import OnInfeasible, Policy
from service.runtime import Runtime


def engine_p50(ladder_dir: Path, rung: str, x: np.ndarray, runs: int) -> float:
    ladder = load_ladder(ladder_dir)
    rec = ladder.rung(rung)
    engine = open_engine(rec.backend, ladder_dir / rec.artifact.path, rec.precision, ladder.threads)
    for _ in range(50):
        engine.run(x)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.run(x)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) * 1e3


def planner_us(ladder_dir: Path, calls: int = 20000) -> dict[str, float]:
    runtime = Runtime(Settings(ladder=ladder_dir), Metrics())  # engines are not loaded: planning only
    out = {}
    for policy in (Policy.CASCADE, Policy.STATIC):
        samples = np.empty(calls)
        for i in range(calls):
            start = time.perf_counter()
            deadline = time.monotonic() + 0.010
            runtime.planner.plan(policy, 10.0, runtime.scheduler.wait_ms(deadline), OnInfeasible.REJECT)
            samples[i] = time.perf_counter() - start
        out[str(policy)] = float(np.median(samples)) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rung", default="exit3.int8.onnxruntime")
    args = parser.parse_args()
    test = FashionMNIST().split("test")
    spec_x = load_ladder(args.ladder)
    from models.data import PreprocessSpec

    x = PreprocessSpec.from_dict(spec_x.preprocess).normalize(test.images[:1])
    payloads = [
        {"image": png_base64(test.images[i % len(test)]), "deadline_ms": 1000, "policy": "fixed", "rung": args.rung}
        for i in range(args.requests)
    ]
    with running_server(args.ladder) as url, httpx.Client(base_url=url, timeout=10) as client:
        for p in payloads[:50]:
            client.post("/v1/classify", json=p)
        client_ms, server_ms = [], []
        for p in payloads:
            start = time.perf_counter()
            body = client.post("/v1/classify", json=p).json()
            client_ms.append((time.perf_counter() - start) * 1e3)
            server_ms.append(body["latency_ms"])
    raw = engine_p50(args.ladder, args.rung, x, args.requests)
    e2e, srv = float(np.median(client_ms)), float(np.median(server_ms))
    print(f"rung {args.rung}, {args.requests} requests at concurrency 1 over one loopback connection")
    print(
        f"HTTP end-to-end p50 {e2e:.3f} ms (p99 {np.percentile(client_ms, 99):.3f}); server-measured p50 "
        f"{srv:.3f} ms; raw engine p50 {raw:.3f} ms"
    )
    print(
        f"server overhead (e2e p50 - engine p50): {e2e - raw:.3f} ms; inside the server (server p50 - engine "
        f"p50): {srv - raw:.3f} ms   goal < 1 ms"
    )
    for policy, us in planner_us(args.ladder).items():
        print(f"planner time per request ({policy}): {us:.1f} us   goal < 50 us")


if __name__ == "__main__":
    main()
