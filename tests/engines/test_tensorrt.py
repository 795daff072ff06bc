"""TensorRT on a GPU (skipped elsewhere): plans of tiny ONNX graphs against ONNX Runtime on the CPU, then the
tiny ladder built with `backend=tensorrt`: plan rungs against ONNX Runtime FP32, the server answering through
plan rungs, and a plan cascade stopping early as its thresholds say."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engines.base import ArtifactError, Backend, Precision, sha256_file, verify_artifact
from engines.manifest import Ladder, load_ladder
from models.data import FashionMNIST
from tests.engines.gpu import needs_tensorrt
from tests.engines.onnx_graphs import ITEM_SHAPE, tiny_calibration, tiny_graph

pytestmark = [pytest.mark.gpu, needs_tensorrt]


def _trt_version() -> tuple[int, int]:
    from engines.backends.tensorrt import require_tensorrt, tensorrt_version

    return tensorrt_version(require_tensorrt())


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


def test_int8_plan(onnx_path: Path, tmp_path: Path) -> None:
    """TensorRT 10: from the symmetric QDQ model; 8.x: from the FP32 model through the entropy calibrator."""
    from engines.backends.tensorrt import TensorRTEngine
    from engines.steps.plans import build_plan

    if _trt_version() >= (10, 0):
        source = tiny_graph(tmp_path / "tiny.qdq.onnx", quantized=True)
        engine = TensorRTEngine(build_plan(source, tmp_path / "tiny.int8.plan", Precision.INT8))
        tol = 5e-2  # same Q/DQ arithmetic on both sides; TensorRT runs FP16 outside the pairs
    else:
        source, calibration = onnx_path, tiny_calibration(tmp_path)
        engine = TensorRTEngine(
            build_plan(source, tmp_path / "tiny.int8.plan", Precision.INT8, calibration=calibration)
        )
        assert calibration.cache.is_file()  # written by the calibrator, read by the next build
        tol = 1e-1  # INT8 against the FP32 model
    try:
        x = _batch(8)
        np.testing.assert_allclose(engine.infer(x), _reference(source, x), rtol=tol, atol=tol)
    finally:
        engine.close()


def test_sidecar_records_what_the_plan_was_built_from(onnx_path: Path, fp32_plan: Path) -> None:
    import tensorrt as trt
    import torch

    meta = json.loads(fp32_plan.with_suffix(".json").read_text())
    assert meta["onnx_sha256"] == sha256_file(onnx_path)
    assert meta["tensorrt_version"] == trt.__version__
    assert meta["gpu_name"] == torch.cuda.get_device_name()
    assert meta["compute_capability"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert meta["cuda_version"] == torch.version.cuda
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


def test_int8_needs_a_qdq_model_or_calibration_data(onnx_path: Path, tmp_path: Path) -> None:
    from engines.steps.plans import build_plan

    with pytest.raises(ValueError, match=r"QuantizeLinear|calibration data"):
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


def test_timing_cache_is_written_and_reused(onnx_path: Path, tmp_path: Path) -> None:
    from engines.steps.plans import build_plan

    cache = tmp_path / "timing.cache"
    build_plan(onnx_path, tmp_path / "a.plan", Precision.FP32, timing_cache=cache)
    first = cache.stat().st_size
    build_plan(onnx_path, tmp_path / "b.plan", Precision.FP16, timing_cache=cache)
    assert first > 0 and cache.stat().st_size >= first


# -- the tiny ladder with TensorRT plans -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_ladder_dir(tiny_ladder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.build import BuildConfig, build_ladder
    from tests.tiny_ladder import TINY_BUILD

    out = tmp_path_factory.mktemp("gpu-plans") / "ladder"
    shutil.copytree(tiny_ladder_dir, out)  # with its build cache: only the TensorRT steps run
    root = tiny_ladder_dir.parent
    config = BuildConfig(members=(root / "vgg_tiny.pt",), backend=Backend.TENSORRT, **TINY_BUILD)  # type: ignore[arg-type]
    build_ladder(root / "resnet_exits_tiny.pt", out, config)
    return out


@pytest.fixture(scope="module")
def plan_ladder(plan_ladder_dir: Path) -> Ladder:
    return load_ladder(plan_ladder_dir)


def _test_logits(ladder_dir: Path, ladder: Ladder, name: str, fmnist: FashionMNIST) -> np.ndarray:
    from engines.factory import open_record
    from engines.steps.evaluate import predict_logits
    from models.preprocess import PreprocessSpec

    engine = open_record(ladder_dir, ladder, ladder.rung(name))
    try:
        return predict_logits(engine, fmnist.split("test"), PreprocessSpec.from_dict(ladder.preprocess), 32)
    finally:
        engine.close()


@pytest.mark.parametrize(("precision", "agreement"), [(Precision.FP32, 0.999), (Precision.FP16, 0.995)])
def test_fp32_and_fp16_plans_agree_with_onnxruntime_fp32(
    plan_ladder_dir: Path, plan_ladder: Ladder, fmnist: FashionMNIST, precision: Precision, agreement: float
) -> None:
    for graph in sorted({r.name.split(".")[0] for r in plan_ladder.rungs if r.backend is Backend.TENSORRT}):
        plan = _test_logits(plan_ladder_dir, plan_ladder, f"{graph}.{precision}.tensorrt", fmnist)
        reference = _test_logits(plan_ladder_dir, plan_ladder, f"{graph}.fp32.onnxruntime", fmnist)
        share = float((plan.argmax(1) == reference.argmax(1)).mean())
        assert share >= agreement, f"{graph} {precision}: top-1 agrees with ONNX Runtime FP32 on {share:.2%}"


def test_int8_plans_lose_at_most_1pp_against_onnxruntime_fp32(plan_ladder: Ladder) -> None:
    for r in plan_ladder.rungs:
        if r.backend is Backend.TENSORRT and r.precision is Precision.INT8:
            reference = plan_ladder.rung(r.name.replace(".int8.tensorrt", ".fp32.onnxruntime"))
            assert r.test_accuracy >= reference.test_accuracy - 0.01, (r.name, r.test_accuracy, reference.test_accuracy)


def test_plan_rungs_record_this_gpu(plan_ladder: Ladder) -> None:
    import tensorrt as trt
    import torch

    plans = [r for r in plan_ladder.rungs if r.backend is Backend.TENSORRT]
    assert plans and all(r.plan is not None and r.max_batch == 32 for r in plans)
    assert {(r.plan.gpu_name, r.plan.tensorrt_version, r.plan.cuda_version) for r in plans if r.plan} == {
        (torch.cuda.get_device_name(), trt.__version__, str(torch.version.cuda))
    }


@pytest.fixture(scope="module")
def plan_server(plan_ladder_dir: Path) -> Iterator[str]:
    from loadtest.harness import running_server

    with running_server(plan_ladder_dir, ANYTIME_MAX_BATCH="256") as url:
        yield url


def _classify(url: str, image: np.ndarray, rung: str) -> dict[str, Any]:
    import httpx

    from loadtest.harness import png_base64

    body = {"image": png_base64(image), "deadline_ms": 5000, "policy": "fixed", "rung": rung}
    answer = httpx.post(f"{url}/v1/classify", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_server_answers_through_plan_rungs(plan_server: str, plan_ladder: Ladder, fmnist: FashionMNIST) -> None:
    images = fmnist.split("test").head(50).images
    for precision in ("fp32", "fp16", "int8"):
        rung = f"exit3.{precision}.tensorrt"
        answers = [_classify(plan_server, image, rung) for image in images]
        assert {(a["rung"], a["backend"]) for a in answers} == {(rung, "tensorrt")}
        assert all(a["deadline_met"] for a in answers)


def test_plan_cascade_stops_early_as_its_thresholds_say(
    plan_server: str, plan_ladder: Ladder, fmnist: FashionMNIST
) -> None:
    cascade = next(c for c in plan_ladder.cascades if c.name == "cascade.fp16.tensorrt")
    images = fmnist.split("test").head(300).images
    stages = [_classify(plan_server, image, cascade.name)["stages_run"] for image in images]
    # With a generous deadline only the entropy gate stops it: the share stopping at stage 1 is the val share.
    share = stages.count(1) / len(stages)
    assert abs(share - cascade.expected_exit_share[0]) <= 0.1, (share, cascade.expected_exit_share)
