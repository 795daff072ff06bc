"""Keep the server's cores awake while it is idle: one spinning process per core, at the lowest CPU priority.

A core with nothing to run halts, and on a virtual machine waking it again goes through the hypervisor; its
caches and clock cool meanwhile. A request that arrives on an idle server pays for all of it: measured on the
2-vCPU VM of this project (2026-11-26, `python -m bench.awake`: exit 1 INT8, one keep-alive client, JSON bodies),
Anytime's client p50 was 0.41-0.42 ms back to back and 0.66-0.85 ms after 20 ms idle, the bare engine's run 0.067
and 0.12-0.13 ms. Processes that spin under Linux's `SCHED_IDLE` policy keep the cores running: the scheduler
gives any other thread the core at once, so they take only time nobody else wants, but the core never halts.
Side by side in the same runs, with them: 0.88-0.98x Anytime's p50 after 5-20 ms idle, 0.70-0.72x under Poisson
load at 600 req/s (about a quarter of its capacity); deadlines met at 1, 2 and 5 ms did not change measurably.

Opt in (`ANYTIME_KEEP_CORES_AWAKE=true`): every core the server may run on then shows 100 % busy to `top` and
to a cloud's CPU metrics, and draws power as a busy core does; not for a battery, a shared desktop or a
Jetson's thermal budget. Linux only. The spinners leave when the server stops, and on their own within
milliseconds if it dies.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger("anytime.awake")

# Runs in each spinner: pinned to one core, SCHED_IDLE, spinning until its parent is gone.
SPIN = """
import os, sys
core, parent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {core})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


def supported() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_getaffinity")


class CoresAwake:
    """Spinners on `cores` (default: every core this process may run on); `start` and `stop` may repeat."""

    def __init__(self, cores: set[int] | None = None) -> None:
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0)) if supported() else []
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> bool:
        """Start the spinners; False (and a warning) where the platform has no SCHED_IDLE."""
        if not supported():
            log.warning("keep_cores_awake needs Linux's SCHED_IDLE scheduling policy; the cores are left to sleep")
            return False
        if not self.processes:
            me = str(os.getpid())
            self.processes = [
                subprocess.Popen([sys.executable, "-c", SPIN, str(core), me], stdin=subprocess.DEVNULL)
                for core in self.cores
            ]
            log.info("keeping cores %s awake (%d spinners at SCHED_IDLE)", self.cores, len(self.processes))
        return True

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.wait()
        self.processes = []
