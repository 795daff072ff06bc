"""The TensorRT backend on a machine without it: the module imports, and building says why it cannot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engines.base import BackendUnavailable, Precision


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_build_plan_without_tensorrt_says_why(tmp_path: Path) -> None:
    import engines.steps.plans

    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(b"never parsed: the backend check comes first")
    with pytest.raises(BackendUnavailable, match=r"(?i)tensorrt|cuda"):
        engines.steps.plans.build_plan(onnx_path, tmp_path / "model.plan", Precision.FP32)
    assert not (tmp_path / "model.plan").exists()
