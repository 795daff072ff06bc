"""Backend conformance, written once and subclassed per backend and precision (on the real default ladder)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from calibration.quantize import int8_saturates
from engines.backends.torch import TorchEngine
from engines.base import Backend, Engine, Precision
from engines.factory import open_engine
from engines.manifest import Ladder, load_ladder
from engines.steps.calibrate import QuantJob, run_quant_job
from engines.steps.export import convert_fp16
from engines.steps.modules import ExitGraph
from models.checkpoint import Checkpoint
from models.data import FashionMNIST
from tests.engines.gpu import needs_tensorrt


@pytest.fixture(scope="module")
def images(fmnist: FashionMNIST, default_checkpoint: Checkpoint) -> tuple[np.ndarray, np.ndarray]:
    """The first 1,000 test images, normalized, and their labels."""
    test = fmnist.split("test").head(1000)
    return default_checkpoint.preprocess.normalize(test.images), test.labels


@functools.cache
def _quantized(ladder_dir: Path, graph: str) -> Path:
    """`graph`'s INT8 file as the build makes it (engines/steps/calibrate.py), for a ladder built without INT8."""
    ladder = load_ladder(ladder_dir, verify=False)
    tmp = Path(tempfile.mkdtemp())
    stage = int(graph.removeprefix("stage")) if graph.startswith("stage") else 0
    run_quant_job(
        QuantJob(
            fp32=str(ladder_dir / f"{graph}.fp32.onnx"),
            cpu=str(tmp / f"{graph}.int8.onnx"),
            trt=None,
            data="fashion-mnist",
            spec=ladder.preprocess,
            samples=ladder.calibration.samples,
            feeders=tuple(str(ladder_dir / f"stage{s}.fp32.onnx") for s in range(1, stage)),
            method=str(ladder.calibration.method),
            ranges=str(tmp / "ranges.json"),
            reduce_range=int8_saturates(),
        )
    )
    return tmp / f"{graph}.int8.onnx"


class EngineConformance:
    backend: Backend
    precision: Precision
    logit_tolerance: float | None  # max abs logit difference against torch; None: not comparable (INT8)
    min_agreement = 0.98  # top-1 agreement with FP32 torch on 1,000 test images

    def open(self, ladder_dir: Path, ladder: Ladder, name: str) -> Engine:
        record = next((r for r in [*ladder.rungs, *ladder.stages] if r.name == name), None)
        if record is None:
            return self.open_unbuilt(ladder_dir, name)
        return open_engine(
            record.backend, ladder_dir / record.artifact.path, record.precision, 2, record.artifact.sha256
        )

    def open_unbuilt(self, ladder_dir: Path, name: str) -> Engine:
        """A precision the probe did not build on this machine: the engine the builder would make, from the
        ladder's FP32 file (OpenVINO runs it in BF16; FP16 is converted as the export step converts it; INT8 is
        calibrated as the build calibrates, with the ladder's method and samples)."""
        graph = name.split(".")[0]
        fp32 = ladder_dir / f"{graph}.fp32.onnx"
        if self.precision is Precision.BF16:
            return open_engine(self.backend, fp32, self.precision, 2)
        if self.precision is Precision.FP16:
            fp16 = convert_fp16(fp32, Path(tempfile.mkdtemp()) / fp32.name.replace(".fp32.", ".fp16."))
            return open_engine(self.backend, fp16, self.precision, 2)
        if self.precision is Precision.INT8:
            return open_engine(self.backend, _quantized(ladder_dir, graph), self.precision, 2)
        raise AssertionError(f"{name} is not in the ladder")

    def exit_engine(self, ladder_dir: Path, ladder: Ladder, k: int) -> Engine:
        return self.open(ladder_dir, ladder, f"exit{k}.{self.precision}.{self.backend}")

    @pytest.mark.parametrize("k", [1, 2, 3])
    def test_logits_match_torch(
        self,
        k: int,
        default_ladder_dir: Path,
        default_ladder: Ladder,
        default_checkpoint: Checkpoint,
        images: tuple[np.ndarray, np.ndarray],
    ) -> None:
        x, _ = images
        engine = self.exit_engine(default_ladder_dir, default_ladder, k)
        got = np.concatenate([engine.infer(x[i : i + 100]) for i in range(0, len(x), 100)])
        with torch.inference_mode():
            ref = default_checkpoint.build_model()(torch.from_numpy(x), exit=k).numpy()
        if self.logit_tolerance is not None:
            assert np.abs(got - ref).max() <= self.logit_tolerance
        assert (got.argmax(1) == ref.argmax(1)).mean() >= self.min_agreement

    def test_batch_sizes_agree(
        self, default_ladder_dir: Path, default_ladder: Ladder, images: tuple[np.ndarray, np.ndarray]
    ) -> None:
        engine = self.exit_engine(default_ladder_dir, default_ladder, 3)
        x = images[0][:8]
        one_by_one = np.concatenate([engine.infer(x[i : i + 1]) for i in range(8)])
        assert np.allclose(engine.infer(x), one_by_one, atol=1e-3 if self.precision is Precision.FP32 else 0.05)

    def test_stage_chain_equals_monolithic_exits(
        self, default_ladder_dir: Path, default_ladder: Ladder, images: tuple[np.ndarray, np.ndarray]
    ) -> None:
        cpu_cascades = {(Backend.ONNXRUNTIME, Precision.FP32), (Backend.ONNXRUNTIME, Precision.INT8)}
        if (self.backend, self.precision) not in {*cpu_cascades, (Backend.OPENVINO, Precision.BF16)}:
            pytest.skip(f"no {self.precision} cascade on {self.backend} in the CPU ladder")
        x = images[0][:200]
        feats = x
        for k in (1, 2, 3):
            feats, chained = self.open(
                default_ladder_dir, default_ladder, f"stage{k}.{self.precision}.{self.backend}"
            ).run(feats)
            mono = self.exit_engine(default_ladder_dir, default_ladder, k).infer(x)
            if self.precision is Precision.INT8:  # stages and exits are calibrated separately
                assert (chained.argmax(1) == mono.argmax(1)).mean() >= self.min_agreement
            else:
                assert np.abs(chained - mono).max() <= (1e-4 if self.precision is Precision.FP32 else 0.5)


class TestOnnxRuntimeFP32(EngineConformance):
    backend, precision, logit_tolerance = Backend.ONNXRUNTIME, Precision.FP32, 1e-4


class TestOnnxRuntimeINT8(EngineConformance):
    backend, precision, logit_tolerance = Backend.ONNXRUNTIME, Precision.INT8, None


class TestOnnxRuntimeFP16(EngineConformance):
    backend, precision, logit_tolerance = Backend.ONNXRUNTIME, Precision.FP16, 0.05


class TestOpenVinoBF16(EngineConformance):
    backend, precision, logit_tolerance = Backend.OPENVINO, Precision.BF16, 0.5


class TestTorchReference(EngineConformance):
    backend, precision, logit_tolerance = Backend.TORCH, Precision.FP32, 1e-5  # batch 100 vs 1000: float order

    def open(self, ladder_dir: Path, ladder: Ladder, name: str) -> Engine:
        pytest.skip("the torch engine has no stage files")

    def exit_engine(self, ladder_dir: Path, ladder: Ladder, k: int) -> Engine:
        from models.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint

        model = load_checkpoint(DEFAULT_CHECKPOINT).build_model()
        return TorchEngine(ExitGraph(model, k), (1, 28, 28), ["logits"])


class _TensorRTConformance(EngineConformance):
    """Plans built from the ladder's own ONNX: FP16 by builder flag from the FP32 file, INT8 from the
    symmetric QDQ file."""

    backend = Backend.TENSORRT

    def open(self, ladder_dir: Path, ladder: Ladder, name: str) -> Engine:
        from engines.backends.tensorrt import TensorRTEngine
        from engines.steps.plans import build_plan

        graph = name.split(".")[0]
        source = ladder_dir / (f"{graph}.int8.trt.onnx" if self.precision is Precision.INT8 else f"{graph}.fp32.onnx")
        plan = build_plan(source, Path(tempfile.mkdtemp()) / f"{graph}.{self.precision}.plan", self.precision)
        return TensorRTEngine(plan)


@pytest.mark.gpu
@needs_tensorrt
class TestTensorRTFP16(_TensorRTConformance):
    precision, logit_tolerance = Precision.FP16, 0.05


@pytest.mark.gpu
@needs_tensorrt
class TestTensorRTINT8(_TensorRTConformance):
    precision, logit_tolerance = Precision.INT8, None
