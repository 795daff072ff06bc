"""Run a real `anytime serve` (or any HTTP server) subprocess on a free loopback port (tests, benchmarks, baselines)."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_base64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@contextmanager
def running_server(
    ladder: Path, timeout_s: float = 120, log: Path | None = None, wrap: Sequence[str] = (), **env: str
) -> Iterator[str]:
    """Start the server, wait for /readyz 200, yield its base URL; always stops it. Its log goes to `log`.

    `wrap`: a command the server runs under (e.g. valgrind's, bench/instructions.py)."""
    port = free_port()
    exe = Path(sys.executable).parent / "anytime"
    argv = [*wrap, sys.executable, str(exe), "serve", "--ladder", str(ladder), "--port", str(port)]
    with running_process(argv, port, timeout_s, env, log) as url:
        yield url


def reap(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Wait for a process asked to stop; kill it if it has not within `timeout_s`."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_process(
    argv: list[str], port: int, timeout_s: float = 120, env: dict[str, str] | None = None, log_path: Path | None = None
) -> Iterator[str]:
    """Start an HTTP server process that listens on loopback `port`, wait for /readyz 200, yield its base URL.

    Its stdout and stderr go to `log_path` (kept), or to a temporary file.
    """
    url = f"http://127.0.0.1:{port}"
    # The log goes to a file, not a pipe: a pipe nobody reads fills up under load and blocks the server.
    log = open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=url, timeout=2) as client:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited: {log.read().decode(errors='replace')[-2000:]}")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("server not ready in time")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        reap(proc, 10)
        log.close()
