"""Keeping the cores awake (service/awake.py): real spinner processes, at SCHED_IDLE, one per core, gone with
the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from loadtest.harness import free_port
from service.awake import CoresAwake, supported

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux's SCHED_IDLE")


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _spinning_idle(pid: int) -> bool:
    try:
        return os.sched_getscheduler(pid) == os.SCHED_IDLE
    except ProcessLookupError:
        return False


def test_one_spinner_per_core_at_idle_priority_pinned_and_stopped() -> None:
    awake = CoresAwake()
    assert awake.cores == sorted(os.sched_getaffinity(0))
    assert awake.start()
    try:
        pids = [p.pid for p in awake.processes]
        assert len(pids) == len(awake.cores)
        assert awake.start() and [p.pid for p in awake.processes] == pids  # a second start starts nothing
        assert _wait(lambda: all(_spinning_idle(pid) for pid in pids))
        assert [os.sched_getaffinity(pid) for pid in pids] == [{core} for core in awake.cores]
    finally:
        awake.stop()
    assert awake.processes == [] and all(_gone(pid) for pid in pids)


def test_a_spinner_leaves_on_its_own_when_its_server_dies() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "from service.awake import CoresAwake\n"
            "awake = CoresAwake({min(os.sched_getaffinity(0))})\n"
            "awake.start()\n"
            "print(awake.processes[0].pid, flush=True)\n"
            "sys.stdin.readline()\n"
            "os._exit(0)  # no stop(): as a crash\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None and parent.stdin is not None
    spinner = int(parent.stdout.readline())
    assert _wait(lambda: _spinning_idle(spinner))
    parent.stdin.write("\n")
    parent.stdin.flush()
    assert parent.wait(10) == 0
    assert _wait(lambda: _gone(spinner), 5.0)


def test_the_server_keeps_its_cores_awake_when_asked_and_stops_them_on_sigterm(ladder_dir: Path) -> None:
    port = free_port()
    exe = Path(sys.executable).parent / "anytime"
    env = {**os.environ, "ANYTIME_KEEP_CORES_AWAKE": "true"}
    proc = subprocess.Popen(
        [str(exe), "serve", "--ladder", str(ladder_dir), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        assert _wait(ready, 120)
        cores = len(os.sched_getaffinity(0))
        assert _wait(lambda: len(_children(proc.pid)) == cores and all(map(_spinning_idle, _children(proc.pid))))
        spinners = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert _wait(lambda: all(_gone(pid) for pid in spinners), 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
