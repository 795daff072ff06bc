"""What the scheduler spends around one inline engine run: microseconds per job beyond the engine itself.

A quick engine runs on the event loop (service/scheduler.py), and everything the scheduler does around the run
(the job's bookkeeping, the latency observation, metrics, the answer's logits, the completion callback) is event
loop time too, which under load every request waits behind. Method: the runtime exactly as `anytime serve`
builds it (default settings, the ladder's engines loaded), one image, and `Scheduler.submit(job, inline=True)` of a
`fixed` plan on the quickest rung, `--jobs` times after 2,000 warm-up jobs; per job, the wall time minus the
engine's own run (`Job.run_s`, timed by the scheduler around the engine call). Best of `--repeats` (the least
disturbed run on a shared machine). Also prints the bare engine's run in the same process and the ratio of the
two. Where the quickest rung's profile is over `ANYTIME_INLINE_MAX_MS` (an AVX2-only machine, say), the server
sends it to the worker; the bookkeeping measured here is the same either way, so the limit is raised to the rung's
profile for this measurement, and the benchmark says so.

Then the same jobs handed to the worker thread one at a time (`submit(job)`, the caller waiting on an event the
completion sets): per job, the wall time minus the engine's run is the scheduler's bookkeeping plus the two thread
wake-ups, what a request pays for a run on the worker (the server's hand-back wakes the event loop instead of a
thread: bench.frontdoor's Server-Timing `queue` and `handback`). Median of each repeat, best repeat.

    python -m bench.inline [--ladder ladders/default] [--jobs 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.config import Settings
from service.metrics import Metrics
from service.planner import OnInfeasible, Policy
from service.runtime import Runtime
from service.scheduler import Job


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    runtime = Runtime(Settings(ladder=args.ladder), Metrics())
    runtime.load()
    try:
        planner, predictor, scheduler = runtime.planner, runtime.predictor, runtime.scheduler
        rung = min((o for o in planner.auto if len(o.engines) == 1), key=lambda o: predictor.profiled_p50(o.engines[0]))
        engine = runtime.engines[rung.engines[0]]
        profiled = predictor.profiled_p50(rung.engines[0])
        if profiled > scheduler.inline_max_ms:
            print(
                f"{rung.name} profiles at {profiled:.3f} ms, over the inline limit ({scheduler.inline_max_ms} ms): "
                "the server runs it on the worker; raised to its profile here to time the inline bookkeeping"
            )
            scheduler.inline_max_ms = profiled
        x = np.random.default_rng(0).random((1, *runtime.spec.input_shape), dtype=np.float32)
        plan = planner.plan(Policy.FIXED, 1e3, 0.0, OnInfeasible.REJECT, rung.name)

        def job(done: Callable[[Job], None] = lambda _: None, inline: bool = True) -> Job:
            now = time.monotonic()
            j = Job("bench", now, now + 1.0, x, plan, done)
            scheduler.submit(j, inline=inline)
            return j

        for _ in range(2000):
            job()
        around, bare = float("inf"), float("inf")
        for _ in range(args.repeats):
            start, run = time.perf_counter(), 0.0
            for _ in range(args.jobs):
                run += job().run_s
            around = min(around, ((time.perf_counter() - start) - run) / args.jobs * 1e6)
            start = time.perf_counter()
            for _ in range(args.jobs):
                engine.run(x)
            bare = min(bare, (time.perf_counter() - start) / args.jobs * 1e6)
        on_worker, finished, handed = float("inf"), threading.Event(), min(args.jobs, 1000)

        def done(_: Job) -> None:
            finished.set()

        for _ in range(args.repeats):
            waits = []
            for _ in range(handed):
                finished.clear()
                start = time.perf_counter()
                j = job(done, inline=False)
                if not finished.wait(5.0):
                    raise SystemExit("the worker did not finish a job within 5 s")
                waits.append((time.perf_counter() - start - j.run_s) * 1e6)
            on_worker = min(on_worker, statistics.median(waits))
        print(f"{rung.name}, best of {args.repeats} x {args.jobs} jobs:")
        print(f"  bare engine run                        {bare:7.1f} us")
        print(f"  scheduler around the run, inline       {around:7.1f} us  ({around / bare:.2f}x the engine)")
        print(
            f"  scheduler around the run, on the worker {on_worker:6.1f} us  (median of {handed} a repeat; two thread "
            "wake-ups)"
        )
    finally:
        runtime.close()


if __name__ == "__main__":
    main()
