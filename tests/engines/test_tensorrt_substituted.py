"""The plan step and the TensorRT engine on a CPU, with only TensorRT and CUDA substituted (tests/fakes/).

What is checked is our side of the API: the flags, profiles, timing cache, calibrator and buffers we hand
TensorRT, the sidecar we write, and the refusals. The numbers are ONNX Runtime's (the substitute runs the
ONNX file), so these tests say nothing about TensorRT's accuracy or speed: tests/engines/test_tensorrt.py does,
on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines.backends.tensorrt import TensorRTEngine
from engines.base import ArtifactError, Backend, BackendUnavailable, Precision, sha256_file
from engines.steps.plan_rungs import choose_backend
from engines.steps.plans import build_plan
from tests.engines.onnx_graphs import ITEM_SHAPE, tiny_calibration, tiny_graph
from tests.fakes import tensorrt as fake_trt
from tests.fakes.gpu import GPU_NAME, substitute


def _substitute(monkeypatch: pytest.MonkeyPatch, version: str = "10.0.1", gpu: str = GPU_NAME) -> None:
    substitute(monkeypatch.setitem, monkeypatch.setattr, version, gpu)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _substitute(monkeypatch)


@pytest.fixture
def onnx_path(tmp_path: Path) -> Path:
    return tiny_graph(tmp_path / "tiny.onnx")


def _batch(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((n, *ITEM_SHAPE), dtype=np.float32)


def _reference(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _header(plan: Path) -> dict[str, object]:
    return fake_trt.read_plan(plan.read_bytes())[0]


@pytest.mark.parametrize(("precision", "flags"), [(Precision.FP32, []), (Precision.FP16, ["FP16", "TF32"])])
def test_plan_flags_profile_and_sidecar_substituted(
    gpu: None, onnx_path: Path, tmp_path: Path, precision: Precision, flags: list[str]
) -> None:
    plan = build_plan(onnx_path, tmp_path / f"tiny.{precision}.plan", precision, batch_sizes=(1, 4, 16))
    # FP32 is the accuracy reference: TF32 (on by default) is cleared; FP16 is the builder flag.
    assert _header(plan)["flags"] == flags
    assert _header(plan)["profile"] == {"min": 1, "opt": 4, "max": 16}
    meta = json.loads(plan.with_suffix(".json").read_text())
    assert meta["tensorrt_version"] == "10.0.1" and meta["gpu_name"] == GPU_NAME
    assert (meta["compute_capability"], meta["cuda_version"]) == ("8.7", "12.6")
    assert (meta["onnx_sha256"], meta["onnx_file"], meta["precision"]) == (
        sha256_file(onnx_path),
        "tiny.onnx",
        precision,
    )
    assert meta["profile"] == {"min": 1, "opt": 4, "max": 16} and meta["int8"] is None


def test_engine_runs_batches_through_its_buffers_substituted(gpu: None, onnx_path: Path, tmp_path: Path) -> None:
    plan = build_plan(onnx_path, tmp_path / "tiny.plan", Precision.FP32, batch_sizes=(1, 8))
    engine = TensorRTEngine(plan, onnx_sha256=sha256_file(onnx_path), sha256=sha256_file(plan))
    assert (engine.input_name, engine.output_names, engine.input_shape) == ("x", ["logits"], ITEM_SHAPE)
    assert (engine.min_batch, engine.max_batch, engine.concurrent) == (1, 8, False)
    # Every batch size, in any order, through buffers allocated once at the largest batch.
    for n in (8, 1, 5, 8, 2):
        x = _batch(n, seed=n)
        (logits,) = engine.run(x)
        np.testing.assert_allclose(logits, _reference(onnx_path, x), rtol=1e-6, atol=1e-6)
    outputs, ms = engine.run_timed(_batch(3))
    assert outputs[0].shape == (3, 3) and ms >= 0
    with pytest.raises(ValueError, match=r"profile 1\.\.8"):
        engine.run(_batch(9))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.run(_batch(1))


def test_timing_cache_is_kept_and_reused_substituted(gpu: None, onnx_path: Path, tmp_path: Path) -> None:
    cache = tmp_path / "plans" / "timing.cache"
    build_plan(onnx_path, tmp_path / "a.plan", Precision.FP32, timing_cache=cache)
    first = json.loads(cache.read_text())
    build_plan(onnx_path, tmp_path / "b.plan", Precision.FP16, timing_cache=cache)
    second = json.loads(cache.read_text())
    assert len(first) == 1 and second[:1] == first and len(second) == 2  # the second build started from the first


def test_int8_from_the_qdq_file_on_tensorrt_10_substituted(gpu: None, onnx_path: Path, tmp_path: Path) -> None:
    qdq = tiny_graph(tmp_path / "tiny.int8.trt.onnx", quantized=True)
    plan = build_plan(qdq, tmp_path / "tiny.int8.plan", Precision.INT8)
    assert _header(plan)["flags"] == ["FP16", "INT8", "TF32"] and _header(plan)["qdq"] is True
    assert json.loads(plan.with_suffix(".json").read_text())["int8"] == "qdq"
    with pytest.raises(ValueError, match="QuantizeLinear"):
        build_plan(onnx_path, tmp_path / "fp32-as-int8.plan", Precision.INT8)


def test_int8_through_the_entropy_calibrator_on_tensorrt_8_substituted(
    monkeypatch: pytest.MonkeyPatch, onnx_path: Path, tmp_path: Path
) -> None:
    _substitute(monkeypatch, version="8.6.1")
    calibration = tiny_calibration(tmp_path)
    plan = build_plan(onnx_path, tmp_path / "tiny.int8.plan", Precision.INT8, calibration=calibration)
    header = _header(plan)
    assert header["flags"] == ["FP16", "INT8", "TF32"] and header["qdq"] is False
    # Every calibration batch reached the builder through device memory, and the cache was written.
    inputs = np.concatenate(list(calibration.data.batches()))
    assert header["calibration"] == {"batches": 4, "input_absmax": float(np.abs(inputs).max()), "from_cache": False}
    assert json.loads(calibration.cache.read_text())["batches"] == 4
    assert json.loads(plan.with_suffix(".json").read_text())["int8"] == "entropy_calibrator"
    # A second build reads the calibration cache instead of calibrating again.
    again = build_plan(onnx_path, tmp_path / "again.int8.plan", Precision.INT8, calibration=calibration)
    assert _header(again)["calibration"]["from_cache"] is True  # type: ignore[index]
    with pytest.raises(ValueError, match="calibration data"):
        build_plan(onnx_path, tmp_path / "none.int8.plan", Precision.INT8)


def test_tensorrt_8_networks_are_explicit_batch_substituted(
    monkeypatch: pytest.MonkeyPatch, onnx_path: Path, tmp_path: Path
) -> None:
    _substitute(monkeypatch, version="8.6.1")
    engine = TensorRTEngine(build_plan(onnx_path, tmp_path / "tiny.plan", Precision.FP16))
    np.testing.assert_allclose(engine.infer(_batch(4)), _reference(onnx_path, _batch(4)), rtol=1e-6, atol=1e-6)


def test_tensorrt_older_than_8_6_is_refused(monkeypatch: pytest.MonkeyPatch, onnx_path: Path, tmp_path: Path) -> None:
    _substitute(monkeypatch, version="8.5.3")
    with pytest.raises(BackendUnavailable, match=r"8\.5\.3 is too old"):
        build_plan(onnx_path, tmp_path / "tiny.plan", Precision.FP32)


def test_plan_from_another_version_or_gpu_is_refused_substituted(
    monkeypatch: pytest.MonkeyPatch, onnx_path: Path, tmp_path: Path
) -> None:
    _substitute(monkeypatch, version="10.0.1")
    plan = build_plan(onnx_path, tmp_path / "tiny.plan", Precision.FP32)
    TensorRTEngine(plan).close()
    _substitute(monkeypatch, version="10.1.0")
    with pytest.raises(ArtifactError, match=r"built by TensorRT 10\.0\.1, this is 10\.1\.0"):
        TensorRTEngine(plan)
    _substitute(monkeypatch, version="10.0.1", gpu="NVIDIA Jetson AGX Orin")
    with pytest.raises(ArtifactError, match="this GPU is NVIDIA Jetson AGX Orin"):
        TensorRTEngine(plan)
    _substitute(monkeypatch, version="10.0.1")
    with pytest.raises(ArtifactError, match="another ONNX"):
        TensorRTEngine(plan, onnx_sha256="0" * 64)


def test_auto_backend_substituted(monkeypatch: pytest.MonkeyPatch) -> None:
    _substitute(monkeypatch)
    backend, reason = choose_backend("auto")
    assert backend is Backend.TENSORRT and GPU_NAME in reason
    assert choose_backend("onnxruntime")[0] is Backend.ONNXRUNTIME
