"""The benchmark scripts run on the tiny ladder (their figures are the benchmarks' business, not the tests')."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench import inline


def test_bench_inline_times_both_paths_when_the_quickest_rung_is_over_the_inline_limit(
    ladder_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With every rung over ANYTIME_INLINE_MAX_MS (as on an AVX2-only machine, where the quickest took 0.37 ms) the
    jobs it submitted inline went to the worker and filled the queue (QueueFull); it now says so, raises the limit for
    its inline figure, and also times the worker's round trip."""
    monkeypatch.setenv("ANYTIME_INLINE_MAX_MS", "0")
    monkeypatch.setattr(sys, "argv", ["bench.inline", "--ladder", str(ladder_dir), "--jobs", "300", "--repeats", "1"])
    inline.main()
    out = capsys.readouterr().out
    assert "over the inline limit (0.0 ms)" in out
    figures = {k: float(v) for k, v in re.findall(r"(bare engine run|inline|on the worker)\s+([0-9.]+) us", out)}
    assert set(figures) == {"bare engine run", "inline", "on the worker"} and all(v > 0 for v in figures.values())
