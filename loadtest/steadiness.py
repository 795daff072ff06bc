"""Machine steadiness: how often this machine's CPU runs far below its own speed, measured beside a benchmark.

The shared 2-vCPU machines here slow down in episodes that no guest counter shows as steal time. Measured
2026-11-28 on the Intel Xeon (KVM, VNNI), on an otherwise idle machine: a fixed chunk of work run back to back
did less than half of its usual amount in 7 % (C, 20 s) and 11 % (this module's Python loop, 20 s) of 10 ms
windows, in episodes of 20-110 ms about every 1.5 s. During a load test at 200 req/s with 5 ms deadlines the
Anytime server's event loop stalled 10-30 ms in the same rhythm; its thread was on the CPU through those
stalls (`/proc/<pid>/task/<tid>/schedstat`: 122 of 131 ms on the CPU, 5 ms waiting for one), doing ordinary
request work (`perf`: the same mix of interpreter, ONNX Runtime and zlib as outside them) at 1.6-8.4 ms of CPU per
answer against 1.3 ms on average. So an answer late in such a spell is the machine's, and every figure a
benchmark prints on such a machine carries it; `bench.frontdoor` and `anytime sweep` print this measurement
before and after their runs so that a reader can tell a steady machine from one that is not.

The probe: one thread runs a fixed pure-Python chunk (a 200-step loop, about 5 us there) for `seconds` and counts
the chunks started in each window of `window_s`. A window's speed is its count over the reference, the 90th
percentile of the counts (a steady machine's usual speed; the best window would follow the rare fast one). It
takes one core for those seconds, so it runs before and after a benchmark, never during one.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

WINDOW_S = 0.01
SLOW = 0.5  # a window doing under this share of the reference's work is slow
SPELL_WINDOWS = 2  # a slow spell: this many slow windows in a row, or more
JOIN_S = 0.2  # slow spells that start within this of the one before belong to one episode
REFERENCE_PERCENTILE = 0.9
CHUNK_STEPS = 200


@dataclass(frozen=True)
class Steadiness:
    seconds: float
    windows: int
    slow_share: float  # the share of windows that did under SLOW of the reference's work
    spells: int  # runs of SPELL_WINDOWS or more slow windows in a row
    longest_ms: float  # the longest such run
    episodes: int  # groups of spells, each starting within JOIN_S of the one before
    spacing_s: float | None  # the median time between the starts of consecutive episodes (None: under two)

    def describe(self) -> str:
        spacing = f", about every {self.spacing_s:.1f} s" if self.spacing_s is not None else ""
        window_ms = 1e3 * self.seconds / self.windows
        return (
            f"{100 * self.slow_share:.1f} % of {self.windows} windows of {window_ms:g} ms under half speed; "
            f"{_count(self.spells, 'slow spell')} of {SPELL_WINDOWS * window_ms:g} ms or more, "
            f"the longest {self.longest_ms:.0f} ms, in "
            f"{_count(self.episodes, 'episode')}{spacing} ({self.seconds:g} s of a fixed Python loop on one core)"
        )

    def plain(self) -> dict[str, Any]:
        return asdict(self)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _chunk() -> int:
    x = 0
    for i in range(CHUNK_STEPS):
        x += i
    return x


def speed_counts(seconds: float, window_s: float = WINDOW_S) -> list[int]:
    """Chunks started in each window of `window_s` over `seconds` of running them back to back."""
    if seconds <= 0 or window_s <= 0:
        raise ValueError("seconds and window_s must be positive")
    windows = max(int(seconds / window_s), 1)
    counts = [0] * windows
    start = time.perf_counter()
    while (k := int((time.perf_counter() - start) / window_s)) < windows:
        _chunk()
        counts[k] += 1
    return counts


def summarize(counts: list[int], window_s: float = WINDOW_S) -> Steadiness:
    """The steadiness of a run of window counts (a pure function of them)."""
    if not counts:
        raise ValueError("no windows")
    reference = sorted(counts)[min(int(REFERENCE_PERCENTILE * len(counts)), len(counts) - 1)]
    slow = [c < SLOW * reference for c in counts]
    starts, lengths, run = [], [], 0
    for k, s in enumerate([*slow, False]):
        if s:
            run += 1
            continue
        if run >= SPELL_WINDOWS:
            starts.append(k - run)
            lengths.append(run)
        run = 0
    episodes = [a for i, a in enumerate(starts) if i == 0 or (a - starts[i - 1]) * window_s >= JOIN_S]
    gaps = sorted(b - a for a, b in pairwise(episodes))
    return Steadiness(
        seconds=round(len(counts) * window_s, 3),
        windows=len(counts),
        slow_share=sum(slow) / len(counts),
        spells=len(starts),
        longest_ms=max(lengths, default=0) * window_s * 1e3,
        episodes=len(episodes),
        spacing_s=gaps[len(gaps) // 2] * window_s if gaps else None,
    )


def measure(seconds: float = 5.0) -> Steadiness:
    """Run the probe for `seconds` on this thread (it takes one core meanwhile)."""
    return summarize(speed_counts(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the probe runs (default: %(default)s)")
    args = parser.parse_args()
    if not args.seconds > 0:
        parser.error("--seconds must be positive")
    print(measure(args.seconds).describe())


if __name__ == "__main__":
    main()
