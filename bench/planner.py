"""What planning a request costs on the event loop, per policy: microseconds per `Planner.plan` call.

Method: the ladder's planner with the builder's profiles as the only latency figures (no observations),
an empty queue, deadlines of 3 and 10 ms; each configuration planned `--plans` times after 1,000 warm-up
calls, best of `--repeats` (the least disturbed run on a shared machine). Prints the plan each one picks.

    python -m bench.planner [--ladder ladders/default] [--plans 20000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engines.manifest import load_ladder
from service.planner import OnInfeasible, Planner, Policy
from service.predictor import LatencyPredictor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    p.add_argument("--plans", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ladder = load_ladder(args.ladder)
    planner = Planner(ladder, LatencyPredictor([*ladder.rungs, *ladder.ensembles, *ladder.stages]), margin_ms=1.0)
    fastest = min((r for r in ladder.rungs if not r.dominated), key=lambda r: r.profile(1).p50_ms).name
    print(f"{len(planner.auto)} options served to auto; microseconds per plan (best of {args.repeats}):")
    for policy, rung in ((Policy.AUTO, None), (Policy.CASCADE, None), (Policy.STATIC, None), (Policy.FIXED, fastest)):
        for deadline in (3.0, 10.0):

            def plan(policy: Policy = policy, rung: str | None = rung, deadline: float = deadline) -> str:
                return planner.plan(policy, deadline, 0.0, OnInfeasible.REJECT, rung).name

            for _ in range(1000):
                plan()
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.plans):
                    plan()
                best = min(best, (time.perf_counter() - start) / args.plans * 1e6)
            print(f"  {policy:<8} deadline {deadline:4.0f} ms  {best:7.1f} us   -> {plan()}")


if __name__ == "__main__":
    main()
