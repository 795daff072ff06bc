"""TensorRT plans built from tiny ONNX graphs, checked against ONNX Runtime on the CPU (GPU machines only)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines.base import ArtifactError, Precision, sha256_file, verify_artifact
from tests.engines.onnx_graphs import ITEM_SHAPE, tiny_graph


def _has_trt_gpu() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_trt_gpu(), reason="needs tensorrt and a CUDA GPU")]


def _reference(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _batch(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((n, *ITEM_SHAPE), dtype=np.float32)


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_graph(tmp_path_factory.mktemp("onnx") / "tiny.onnx")


@pytest.fixture(scope="module")
def fp32_plan(onnx_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.steps.plans import build_plan

    return build_plan(onnx_path, tmp_path_factory.mktemp("plan") / "tiny.fp32.plan", Precision.FP32)


@pytest.mark.parametrize(("precision", "tol"), [(Precision.FP32, 1e-4), (Precision.FP16, 1e-2)])
def test_plan_matches_onnxruntime(onnx_path: Path, tmp_path: Path, precision: Precision, tol: float) -> None:
    from engines.backends.tensorrt import TensorRTEngine
    from engines.steps.plans import build_plan

    plan = build_plan(onnx_path, tmp_path / f"tiny.{precision}.plan", precision)
    engine = TensorRTEngine(plan, onnx_sha256=sha256_file(onnx_path), sha256=sha256_file(plan))
    try:
        assert engine.precision is precision
        assert (engine.input_name, engine.output_names, engine.input_shape) == ("x", ["logits"], ITEM_SHAPE)
        for n in (1, 8):
            x = _batch(n)
            (logits,) = engine.run(x)
            assert logits.dtype == np.float32
            np.testing.assert_allclose(logits, _reference(onnx_path, x), rtol=tol, atol=tol)
    finally:
        engine.close()


def test_int8_plan_from_qdq_model(tmp_path: Path) -> None:
    from engines.backends.tensorrt import TensorRTEngine
    from engines.steps.plans import build_plan

    qdq = tiny_graph(tmp_path / "tiny.qdq.onnx", quantized=True)
    engine = TensorRTEngine(build_plan(qdq, tmp_path / "tiny.int8.plan", Precision.INT8))
    try:
        x = _batch(8)
        # Same Q/DQ arithmetic on both sides; the loose tolerance covers TensorRT's FP16 outside the pairs.
        np.testing.assert_allclose(engine.infer(x), _reference(qdq, x), rtol=5e-2, atol=5e-2)
    finally:
        engine.close()


def test_sidecar_records_what_the_plan_was_built_from(onnx_path: Path, fp32_plan: Path) -> None:
    import tensorrt as trt
    import torch

    meta = json.loads(fp32_plan.with_suffix(".json").read_text())
    assert meta["onnx_sha256"] == sha256_file(onnx_path)
    assert meta["tensorrt_version"] == trt.__version__
    assert meta["gpu_name"] == torch.cuda.get_device_name()
    assert meta["precision"] == "fp32"
    assert meta["batch_sizes"] == [1, 8, 32]
    assert meta["profile"] == {"min": 1, "opt": 8, "max": 32}
    assert (meta["input_name"], meta["input_shape"], meta["output_names"]) == ("x", list(ITEM_SHAPE), ["logits"])


def test_engine_refuses_a_plan_from_another_onnx(fp32_plan: Path) -> None:
    from engines.backends.tensorrt import TensorRTEngine

    with pytest.raises(ArtifactError, match="another ONNX"):
        TensorRTEngine(fp32_plan, onnx_sha256="0" * 64)


def test_changed_plan_fails_verification(fp32_plan: Path, tmp_path: Path) -> None:
    from engines.backends.tensorrt import TensorRTEngine

    plan = tmp_path / fp32_plan.name
    shutil.copy(fp32_plan, plan)
    shutil.copy(fp32_plan.with_suffix(".json"), plan.with_suffix(".json"))
    recorded = sha256_file(plan)
    data = bytearray(plan.read_bytes())
    data[len(data) // 2] ^= 0xFF
    plan.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupt"):
        verify_artifact(plan, recorded)
    with pytest.raises(ArtifactError, match="corrupt"):
        TensorRTEngine(plan, sha256=recorded)


def test_int8_needs_a_qdq_model(onnx_path: Path, tmp_path: Path) -> None:
    from engines.steps.plans import build_plan

    with pytest.raises(ValueError, match="QuantizeLinear"):
        build_plan(onnx_path, tmp_path / "tiny.int8.plan", Precision.INT8)


def test_batch_over_profile_max_is_refused(onnx_path: Path, tmp_path: Path) -> None:
    from engines.backends.tensorrt import TensorRTEngine
    from engines.steps.plans import build_plan

    engine = TensorRTEngine(build_plan(onnx_path, tmp_path / "tiny.plan", Precision.FP32, batch_sizes=(1, 8)))
    try:
        assert engine.max_batch == 8
        engine.run(_batch(8))
        with pytest.raises(ValueError, match="profile"):
            engine.run(_batch(9))
    finally:
        engine.close()
