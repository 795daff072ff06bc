"""Schemathesis over the live server's own OpenAPI schema, every check on, a bounded number of examples per
operation: no server error, no answer outside its documented schema (errors included), no traceback in the log.

Runs the `st` command line against a real server rather than the pytest plugin (which does not load under this
pytest); tests/schemathesis.toml states the two widened checks and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.harness import running_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # a real server process, hundreds of generated requests

CONFIG = Path(__file__).parent / "schemathesis.toml"
EXAMPLES = int(os.environ.get("ANYTIME_FUZZ_EXAMPLES", "15"))  # per operation; raise it for a longer hunt
ST = Path(sys.executable).parent / "st"


def _fuzz(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [str(ST), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all"]
    argv += ["-n", str(EXAMPLES), "--seed", "1", "--generation-database", "none", "--workers", "1"]
    argv += ["--no-color", "--request-timeout", "10", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def _assert_clean(result: subprocess.CompletedProcess[str], log: Path) -> None:
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "passed" in result.stdout and "failed" not in result.stdout.split("SUMMARY")[-1].lower()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


def test_schemathesis_finds_nothing_on_the_open_api(ladder_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server(ladder_dir, log=log) as url:
        result = _fuzz(url)
    _assert_clean(result, log)


def test_schemathesis_finds_nothing_behind_an_api_key(ladder_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server(ladder_dir, log=log, ANYTIME_API_KEY="k3y", ANYTIME_API_KEY_METRICS="true") as url:
        result = _fuzz(url, "-H", "Authorization: Bearer k3y")
    _assert_clean(result, log)
