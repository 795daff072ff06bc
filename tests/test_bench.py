"""The benchmark scripts run on the tiny ladder (their figures are the benchmarks' business, not the tests')."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import inline, instructions
from bench.frontdoor import targets
from engines.manifest import Ladder


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


def _frontdoor_report(**changes: Any) -> dict[str, Any]:
    """A bench.frontdoor report (its JSON) in which every target holds; `changes` replaces parts of it."""

    def rung() -> dict[str, Any]:
        return {
            "engine_p50_ms": 0.10,
            "plain": {"p50_ms": 0.60},
            "lean": {"p50_ms": 0.35},
            "json": {"p50_ms": 0.40},
            "png": {"p50_ms": 0.40},
        }

    levels = [
        {
            "level": level,
            "server": server,
            "on_time_5ms": 0.995,
            "statuses": {"200 ok": 900, "503 overloaded": 100} if level == 2.0 else {"200 ok": 1000},
            "server_500s": 0,
            "refusal_p99_ms": 1.2 if level == 2.0 else None,
        }
        for level in (0.25, 0.5, 0.7, 1.0, 2.0)
        for server in ("anytime", "anytime-png", "plain")
    ]
    scan = [[100.0, 1.0], [200.0, 0.995]]
    report: dict[str, Any] = {
        "concurrency_1": {
            "rungs": {"fastest INT8": rung(), "most accurate": rung()},
            "default_2ms": {"on_time": 20, "answered_200": 20},
        },
        "open_loop": {
            "levels": levels,
            "capacity_5ms": {"anytime": 200.0, "anytime-png": 200.0, "plain": 100.0},
            "scan": {"anytime": scan, "anytime-png": scan, "plain": scan},
            "refusal_floor": {"p99_ms": 1.0},
            "log_errors": {"anytime": {"tracebacks": 0, "error_lines": 0}},
        },
    }
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = report
        for key in parents:
            node = node[key]
        node[leaf] = value
    return report


def _verdicts(report: dict[str, Any]) -> dict[str, bool | None]:
    return {t.target: t.met for t in targets(report)}


def test_frontdoor_grades_a_run_that_holds_every_target_as_met() -> None:
    verdicts = _verdicts(_frontdoor_report())
    assert len(verdicts) == 9 + 2 * 6 + 1 and all(v is True for v in verdicts.values())


@pytest.mark.parametrize(
    "statuses",
    [
        {"200 ok": 900, "500 internal_error": 1},
        {"200 ok": 900, "client_timeout": 1},  # no answer at all
        {"200 ok": 900, "503 bad_body": 1},  # a refusal whose body is not JSON
        {"200 ok": 900, "503 http_503": 1},  # a JSON refusal without a code
    ],
)
def test_frontdoor_grades_an_overload_with_any_answer_but_200_or_a_json_refusal_as_missed(
    statuses: dict[str, int],
) -> None:
    report = _frontdoor_report()
    report["open_loop"]["levels"][-3]["statuses"] = statuses  # 2x capacity, Anytime JSON
    missed = [t for t, met in _verdicts(report).items() if met is False]
    assert missed == ["Anytime, JSON/base64, 2x capacity: every request 200 or refused 429/503/504 with JSON, no 500"]


def test_frontdoor_grades_the_5ms_capacity_when_plain_never_reached_99_percent() -> None:
    """Plain under 99 % at the lowest rate scanned: its capacity is below that rate, so 1.5x that rate is enough, and
    less cannot tell (plain's may lie just under it, or far); nor can a run where neither server reached 99 %."""
    capacity = "open_loop.capacity_5ms"
    key = "Anytime, JSON/base64: capacity at 5 ms >= 1.5x plain's"
    assert _verdicts(_frontdoor_report(**{capacity: {"anytime": 200.0, "anytime-png": 200.0, "plain": 0}}))[key]
    slow = _frontdoor_report(**{capacity: {"anytime": 100.0, "anytime-png": 100.0, "plain": 0}})
    assert _verdicts(slow)[key] is None  # 100 req/s, the lowest rate scanned: plain's may be just under it
    none = _frontdoor_report(**{capacity: {"anytime": None, "anytime-png": None, "plain": None}})
    assert _verdicts(none)[key] is None


def test_frontdoor_grades_each_concurrency_1_figure_against_its_target() -> None:
    slow = {"p50_ms": 0.65}  # 0.55 ms over the engine, and above plain's 0.60
    verdicts = _verdicts(_frontdoor_report(**{"concurrency_1.rungs.fastest INT8.json": slow}))
    missed = sorted(t for t, met in verdicts.items() if met is False)
    assert missed == [
        "concurrency 1, fastest INT8 rung, JSON/base64: client p50 - bare engine <= 0.5 ms",
        "concurrency 1, fastest INT8 rung, JSON/base64: client p50 below plain FastAPI + ORT's",
    ]


def test_frontdoor_grades_a_report_from_before_the_refusal_floor() -> None:
    """frontdoor.json files written before the refusal floor was measured have no `refusal_floor`: still graded."""
    report = _frontdoor_report()
    del report["open_loop"]["refusal_floor"]
    verdicts = _verdicts(report)
    assert verdicts["Anytime, JSON/base64, 2x capacity: refusal p99 < 2 ms"] is True


def test_frontdoor_grades_the_2ms_test_at_the_client() -> None:
    """Answers the server had on time but that reached the client after 2 ms are late; an older report, which counted
    only the server's, is graded on that count."""
    key = "default policy, 2 ms deadline, idle server: >= 19 of 20 on time at the client"
    late = _frontdoor_report(**{"concurrency_1.default_2ms": {"on_time": 18, "answered_200": 20}})
    target = next(t for t in targets(late) if t.target == key)
    assert target.met is False and target.figure == "18 of 20 (20 on time by the server's clock)"
    old = _frontdoor_report(**{"concurrency_1.default_2ms": {"on_time": 19}})
    assert _verdicts(old)[key] is True


def test_bench_instructions_reads_self_costs_by_shared_object_and_skips_a_callees_inclusive_cost(
    tmp_path: Path,
) -> None:
    """Callgrind's format names an object once as `(id) name`, then `(id)` alone; the cost line after `calls=` is what
    the callee cost in all (already counted as the callee's own self cost) and must not count twice."""
    dump = tmp_path / "callgrind.1.out.1"
    dump.write_text(
        "version: 1\nevents: Ir\n"
        "ob=(1) /usr/lib/libpython3.11.so.1.0\nfl=(1) ceval.c\nfn=(1) _PyEval_EvalFrameDefault\n10 100\n+2 50\n"
        "cob=(2) /site-packages/onnxruntime/capi/onnxruntime_pybind11_state.so\ncfn=(2) Run\ncalls=1 0\n12 7000\n"
        "ob=(2)\nfn=(2)\n0 7000\n"
        "ob=(1)\nfn=(3) PyObject_Call\n* 25\n"
        "ob=(3) /usr/lib/x86_64-linux-gnu/libz.so.1.2.13\nfn=(4) inflate\n0 300\n"
        "\ntotals: 7475\n"
    )
    by_object = instructions.self_by_object(dump)
    assert by_object == {
        "/usr/lib/libpython3.11.so.1.0": 175,
        "/site-packages/onnxruntime/capi/onnxruntime_pybind11_state.so": 7000,
        "/usr/lib/x86_64-linux-gnu/libz.so.1.2.13": 300,
    }
    assert sum(by_object.values()) == instructions.total(dump)
    assert [instructions.group(name) for name in by_object] == ["Python interpreter", "ONNX Runtime", "zlib (PNG)"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("callgrind_control") is None, reason="needs valgrind")
def test_bench_instructions_counts_a_real_engine_mostly_in_onnx_runtime_and_its_breakdown_adds_up(
    ladder: Ladder, ladder_dir: Path, tmp_path: Path
) -> None:
    """A real engine in its own process under callgrind: zeroed, run, dumped and read; the figure is one window's, so
    its breakdown by shared object adds up to it."""
    rung = min(ladder.rungs, key=lambda r: r.profile(1).p50_ms)
    cg = instructions.Callgrind(tmp_path / "engine")
    with instructions.engine_loop(cg, ladder_dir, rung.name) as send:
        counted = instructions.count(cg, send, 5, 2)
    assert counted["instructions"] == min(counted["repeats"])
    assert sum(counted["by_object"].values()) == pytest.approx(counted["instructions"], rel=1e-9)
    assert counted["by_object"]["ONNX Runtime"] > counted["by_object"]["Python interpreter"] > 0


def test_bench_instructions_ratios_and_differences_cover_only_what_was_counted() -> None:
    """`--only` leaves some processes out: ratios to a process not counted are left out, not failed; `--against`
    compares the processes both runs counted."""

    def counted(ir: float) -> dict[str, Any]:
        return {"instructions": ir, "spread": 0.0, "repeats": [ir], "by_object": {}}

    processes = {"plain": counted(4_000_000), "anytime json": counted(3_500_000), "bare engine": counted(3_000_000)}
    report = {"processes": processes}
    assert instructions.ratios(report) == {
        "plain": {"path": 1e6, "total / plain": 1.0, "path / plain": 1.0},
        "anytime json": {"path": 5e5, "total / plain": 0.875, "path / plain": 0.5},
    }
    assert instructions.ratios({"processes": {"anytime json": counted(3_500_000)}}) == {}
    before = {"processes": {"anytime json": counted(3_510_000), "lean": counted(3_400_000)}}
    lines = instructions.against(report, before).splitlines()
    assert len(lines) == 2 and lines[1].split() == ["anytime", "json", "3,510,000", "3,500,000", "-10,000", "-0.28%"]
