"""The TensorRT backend on a machine without it: the module imports, and building says why it cannot (so does the
CUDA benchmark without a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engines.base import BackendUnavailable, Precision
from tests.engines.gpu import cuda_missing


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_build_plan_without_tensorrt_says_why(tmp_path: Path) -> None:
    import engines.steps.plans

    onnx_path = tmp_path / "model.onnx"
    onnx_path.write_bytes(b"never parsed: the backend check comes first")
    with pytest.raises(BackendUnavailable, match=r"(?i)tensorrt|cuda"):
        engines.steps.plans.build_plan(onnx_path, tmp_path / "model.plan", Precision.FP32)
    assert not (tmp_path / "model.plan").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_auto_falls_back_to_onnxruntime_and_says_why() -> None:
    from engines.base import Backend
    from engines.steps.plan_rungs import choose_backend

    backend, reason = choose_backend("auto")
    assert backend is Backend.ONNXRUNTIME and "tensorrt is not installed" in reason
    with pytest.raises(BackendUnavailable, match="tensorrt is not installed"):
        choose_backend("tensorrt")


@pytest.mark.skipif(cuda_missing() is None, reason="a CUDA GPU is here (tests/engines/test_cuda.py runs the benchmark)")
def test_the_cuda_benchmark_without_a_gpu_says_why_in_one_line() -> None:
    from bench.cuda import main

    with pytest.raises(SystemExit, match=r"^bench\.cuda: no CUDA device"):
        main(["--runs", "10"])
