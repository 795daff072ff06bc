"""The builder redoes only what changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.base import Backend, Precision
from engines.build import BuildConfig, build_ladder
from engines.manifest import Artifact, LatencyProfile, Rung, load_ladder
from engines.steps.pareto import keep_pareto_cuts
from models.checkpoint import DEFAULT_CHECKPOINT

pytestmark = pytest.mark.slow


def test_rebuild_with_nothing_changed_rebuilds_nothing(default_ladder_dir: Path, tmp_path: Path) -> None:
    ladder_dir = tmp_path / "ladder"
    shutil.copytree(default_ladder_dir, ladder_dir)
    before = load_ladder(ladder_dir)
    files = {p.name: p.stat().st_mtime_ns for p in ladder_dir.glob("*.onnx")}
    after = build_ladder(DEFAULT_CHECKPOINT, ladder_dir, BuildConfig(progress=False))
    assert {p.name: p.stat().st_mtime_ns for p in ladder_dir.glob("*.onnx")} == files  # no file rewritten
    assert [r.artifact for r in after.rungs] == [r.artifact for r in before.rungs]
    assert [r.profiles for r in after.rungs] == [r.profiles for r in before.rungs]  # measurements reused
    assert [c.thresholds for c in after.cascades] == [c.thresholds for c in before.cascades]


def _fp32_rung(name: str, kind: str, val: float, ms: float) -> Rung:
    profiles = [LatencyProfile(batch=b, p50_ms=ms * b, p90_ms=ms * b, p99_ms=ms * b, runs=200) for b in (1, 8, 32)]
    artifact = Artifact(path=f"{name}.onnx", sha256="0", bytes=1)
    return Rung(
        name=f"{name}.fp32.onnxruntime",
        precision=Precision.FP32,
        backend=Backend.ONNXRUNTIME,
        artifact=artifact,
        input_shape=[1, 28, 28],
        outputs=["logits"],
        profiles=profiles,
        macs=1,
        peak_memory_bytes=0,
        kind=kind,  # type: ignore[arg-type]
        exit=1,
        val_accuracy=val,
        test_accuracy=val,
    )


def test_cuts_near_chance_are_never_kept() -> None:
    rungs = [
        _fp32_rung("exit1", "exit", 0.90, 0.3),
        _fp32_rung("exit2", "exit", 0.94, 0.9),
        _fp32_rung("cut1", "cut", 0.93, 0.7),  # on the front
        _fp32_rung("cut2", "cut", 0.895, 0.4),  # dominated by exit1, kept to make three
        _fp32_rung("cut3", "cut", 0.86, 0.35),  # 8 pp below the full network: not a candidate
        _fp32_rung("cut4", "cut", 0.10, 0.2),  # the fastest of all, at chance
    ]
    kept_rungs, kept = keep_pareto_cuts(rungs, min_cuts=3, max_drop_pp=5.0)
    assert kept == ["cut1", "cut2"]
    assert [r.name.split(".")[0] for r in kept_rungs] == ["exit1", "exit2", "cut1", "cut2"]
