"""The builder redoes only what changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.build import BuildConfig, build_ladder
from engines.manifest import load_ladder
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
