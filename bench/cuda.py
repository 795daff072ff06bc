"""What the CUDA copies around a batch-1 TensorRT plan cost, without TensorRT: engines/backends/cuda.py's pinned
buffers and stream, as the plan engine uses them per request (upload one 1x1x28x28 float32 image, download
1x10 float32 logits, synchronize the stream, copy the logits out), and a synchronize of an empty stream.

Method: one process, the current CUDA device, 200 warm-up round trips, then `--rounds` rounds of `--runs` timed
round trips each (wall clock, perf_counter_ns); p50 / p90 / p99 per round. No baseline runs here: this is one
component of the plan path, to set beside a plan's own time (`python -m bench.engines` on a ladder built with
`--backend tensorrt`). Needs a CUDA GPU and a CUDA build of torch.

    python -m bench.cuda [--runs 5000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from engines.backends.cuda import open_device
from engines.base import BackendUnavailable


def _percentiles_us(fn: Callable[[], object], runs: int) -> tuple[float, float, float]:
    times = np.empty(runs)
    for i in range(runs):
        start = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - start
    p50, p90, p99 = np.percentile(times / 1000, [50, 90, 99])
    return float(p50), float(p90), float(p99)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="timed round trips per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    try:
        device = open_device()
    except BackendUnavailable as e:
        raise SystemExit(f"bench.cuda: {e}") from None
    print(device.info())
    image, logits = device.buffer((1, 1, 28, 28), np.dtype(np.float32)), device.buffer((1, 10), np.dtype(np.float32))
    x = np.random.default_rng(0).random((1, 1, 28, 28), dtype=np.float32)

    def round_trip() -> np.ndarray:
        image.upload(x)
        logits.download((1, 10))
        device.synchronize()
        return logits.host((1, 10))

    for _ in range(200):
        round_trip()
    for r in range(args.rounds):
        p50, p90, p99 = _percentiles_us(round_trip, args.runs)
        print(f"round {r + 1}: upload + download + synchronize  p50 {p50:.1f} us  p90 {p90:.1f}  p99 {p99:.1f}")
    p50, _, p99 = _percentiles_us(device.synchronize, args.runs)
    print(f"synchronize of an empty stream                  p50 {p50:.1f} us  p99 {p99:.1f}  ({args.runs} runs)")


if __name__ == "__main__":
    main()
