"""What planning a request costs on the event loop, per policy: microseconds per `Planner.plan` call.

Method: the planner exactly as `anytime serve` builds it (service/runtime.py, default settings: caution, the load
budget, ties), an empty queue, deadlines of 3 and 10 ms, in two states:

- profiles: the builder's profiles as the only latency figures, nothing observed;
- under load: before each plan one engine run is observed, as under load where about one engine runs per request
  (the served options' first engines in turn, each at 0.8-2x its profiled median, seeded), so the estimates and
  every choice worked out from them keep changing. It also prints how often a prediction changed
  (`LatencyPredictor.version`).

Each configuration is planned `--plans` times after 1,000 warm-up calls, best of `--repeats` (the least disturbed
run on a shared machine); prints the plan each one picks.

    python -m bench.planner [--ladder ladders/default] [--plans 20000]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from service.config import Settings
from service.metrics import Metrics
from service.planner import OnInfeasible, Policy
from service.runtime import Runtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    p.add_argument("--plans", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    runtime = Runtime(Settings(ladder=args.ladder), Metrics())
    planner, predictor = runtime.planner, runtime.predictor
    fastest = min((o for o in planner.auto if len(o.engines) == 1), key=lambda o: predictor.profiled_p50(o.engines[0]))
    firsts = sorted({o.engines[0] for o in planner.auto})
    print(f"{len(planner.auto)} options served to auto; microseconds per plan (best of {args.repeats}):")
    rng = random.Random(0)
    runs = [(e, predictor.profiled_p50(e) * rng.uniform(0.8, 2.0)) for e in firsts * 64]
    for state in ("profiles", "under load"):

        def observe(i: int, state: str = state) -> None:
            if state == "under load":
                engine, ms = runs[i % len(runs)]
                predictor.observe(engine, 1, ms)

        for policy in (Policy.AUTO, Policy.CASCADE, Policy.STATIC, Policy.FIXED):
            rung = fastest.name if policy is Policy.FIXED else None
            for deadline in (3.0, 10.0):

                def plan(policy: Policy = policy, rung: str | None = rung, deadline: float = deadline) -> str:
                    return planner.plan(policy, deadline, 0.0, OnInfeasible.BEST_EFFORT, rung).name

                for i in range(1000):
                    observe(i)
                    plan()
                best, changes = float("inf"), 0
                for _ in range(args.repeats):
                    version, spent = predictor.version, 0.0
                    for i in range(args.plans):
                        observe(i)  # outside the clock
                        start = time.perf_counter()
                        plan()
                        spent += time.perf_counter() - start
                    best, changes = min(best, spent / args.plans * 1e6), predictor.version - version
                changed = f"  predictions changed {changes} times" if state == "under load" else ""
                print(f"  {state:<10} {policy:<8} deadline {deadline:4.0f} ms  {best:7.1f} us{changed}   -> {plan()}")


if __name__ == "__main__":
    main()
