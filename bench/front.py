"""Is a new ladder's served front as good as an old one's? For every rung and ensemble on the old front, the best
match on the new front: at most `--max-drop-pp` less accurate on val, and its batch-1 p50 against the old one's.

Latency ratios from two ladder.json files come from two builds, possibly on two days of a machine whose
speed moves by 2x; `--retime OLD_DIR NEW_DIR` times each matched pair again side by side in this one run
(interleaved rounds, batch 1, the ladders' threads) and prints that ratio too.

    python -m bench.front OLD/ladder.json NEW/ladder.json [--retime OLD_DIR NEW_DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

MAX_DROP_PP = 0.1
MAX_RATIO = 1.10


def front(ladder: dict[str, Any]) -> list[dict[str, Any]]:
    """The served front: rungs and ensembles not marked dominated."""
    return [r for r in [*ladder["rungs"], *ladder.get("ensembles", [])] if not r.get("dominated")]


def p50(record: dict[str, Any], batch: int = 1) -> float:
    return float(next(p["p50_ms"] for p in record["profiles"] if p["batch"] == batch))


def match(old: dict[str, Any], new_front: list[dict[str, Any]], max_drop_pp: float) -> dict[str, Any]:
    """The fastest new front record at most `max_drop_pp` less accurate; else the most accurate one."""
    close = [r for r in new_front if (r["val_accuracy"] - old["val_accuracy"]) * 100 >= -max_drop_pp - 1e-9]
    if close:
        return min(close, key=p50)
    return max(new_front, key=lambda r: r["val_accuracy"])


def retime(old_dir: Path, new_dir: Path, pairs: list[tuple[str, str]], rounds: int = 5, runs: int = 200) -> list[float]:
    """new/old batch-1 p50 of each pair, timed side by side (round robin) in this process."""
    from engines.factory import open_record
    from engines.manifest import load_ladder

    ladders = {d: load_ladder(d) for d in (old_dir, new_dir)}

    def record(d: Path, name: str) -> Any:
        lad = ladders[d]
        return next(r for r in [*lad.rungs, *lad.ensembles] if r.name == name)

    ratios = []
    for old_name, new_name in pairs:
        engines = [
            open_record(d, ladders[d], record(d, n), ladders[d].threads)
            for d, n in ((old_dir, old_name), (new_dir, new_name))
        ]
        x = np.random.default_rng(0).standard_normal((1, *engines[0].input_shape)).astype(np.float32)  # type: ignore[attr-defined]
        times: list[list[float]] = [[], []]
        for e in engines:
            for _ in range(20):
                e.run(x)
        for _ in range(rounds):
            for i, e in enumerate(engines):
                for _ in range(runs):
                    start = time.perf_counter()
                    e.run(x)
                    times[i].append(time.perf_counter() - start)
        for e in engines:
            e.close()
        ratios.append(float(np.median(times[1]) / np.median(times[0])))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the old ladder.json")
    parser.add_argument("new", type=Path, help="the new ladder.json")
    parser.add_argument("--max-drop-pp", type=float, default=MAX_DROP_PP)
    parser.add_argument("--retime", type=Path, nargs=2, metavar=("OLD_DIR", "NEW_DIR"))
    args = parser.parse_args()
    old, new = (json.loads(p.read_text()) for p in (args.old, args.new))
    new_front = front(new)
    rows = [(o, match(o, new_front, args.max_drop_pp)) for o in front(old)]
    ratios = retime(*args.retime, [(o["name"], n["name"]) for o, n in rows]) if args.retime else None
    header = (
        f"{'old front rung':<64} {'val':>7} {'b1 ms':>7}  {'best new match':<64} {'val':>7} {'b1 ms':>7} "
        f"{'Δpp':>6} {'ratio':>6}"
    )
    print(header + ("  ratio side by side" if ratios else "") + "  ok")
    failures = 0
    for i, (o, n) in enumerate(rows):
        dpp, ratio = (n["val_accuracy"] - o["val_accuracy"]) * 100, p50(n) / p50(o)
        side = ratios[i] if ratios else ratio
        ok = dpp >= -args.max_drop_pp - 1e-9 and side <= MAX_RATIO
        failures += not ok
        line = (
            f"{o['name']:<64} {o['val_accuracy']:>7.2%} {p50(o):>7.3f}  {n['name']:<64} {n['val_accuracy']:>7.2%} "
            f"{p50(n):>7.3f} {dpp:>+6.2f} {ratio:>6.2f}"
        )
        print(line + (f"  {side:>19.2f}" if ratios else "") + f"  {'yes' if ok else 'NO'}")
    print(
        f"{len(rows) - failures} of {len(rows)} old front rungs kept within {args.max_drop_pp} pp and "
        f"{MAX_RATIO:.0%} of their batch-1 p50{' (side by side)' if ratios else ''}"
    )


if __name__ == "__main__":
    main()
