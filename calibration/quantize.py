"""Post-training INT8 quantization to QDQ ONNX: one calibration, two files (CPU form, TensorRT form)."""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from pathlib import Path

import onnx
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationMethod as OrtMethod
from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static

from calibration.data import CalibrationSet, OrtCalibrationReader
from models.compat import StrEnum


class CalibrationMethod(StrEnum):
    MINMAX = "minmax"
    ENTROPY = "entropy"
    PERCENTILE = "percentile"

    @property
    def ort(self) -> OrtMethod:
        return {"minmax": OrtMethod.MinMax, "entropy": OrtMethod.Entropy, "percentile": OrtMethod.Percentile}[self]


class QuantizationError(RuntimeError):
    """A quantized graph that is not of the form its target needs."""


def int8_saturates(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether ONNX Runtime's u8 x s8 kernels on this CPU can saturate: x86 without VNNI.

    Without VNNI (AVX2, AVX-512F) the kernels multiply with VPMADDUBSW, which adds pairs of 8-bit products
    into 16 bits with saturation; full-range 8-bit weights then overflow. ONNX Runtime's and OpenVINO's
    documentation name the remedy: 7-bit weights (`reduce_range`). Measured on an AVX2-only EPYC here
    (2026-11-24): with full-range weights exit 1 INT8 lost 0.74 pp on test and the VGG 2.28 pp on val.
    A CPU with AVX512_VNNI, AVX_VNNI or AMX adds in 32 bits; an ARM CPU (no x86 flags) uses dot-product
    instructions: neither saturates.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:  # not x86
        return False
    return not {"avx512_vnni", "avx_vnni", "amx_int8"}.intersection(flags)


def preprocess(fp32_path: Path, out_path: Path) -> Path:
    """ORT's quant_pre_process (shape inference + graph optimisation); without it INT8 ran 2-5x slower here."""
    quant_pre_process(str(fp32_path), str(out_path), skip_symbolic_shape=False)
    return out_path


def quantize_int8(
    fp32_path: Path,
    cpu_path: Path,
    trt_path: Path | None,
    calib: CalibrationSet,
    method: CalibrationMethod,
    cache_path: Path,
    reduce_range: bool = False,
) -> None:
    """Calibrate once (ranges cached in `cache_path`), then write the CPU and the TensorRT QDQ files.

    CPU form: unsigned activations, signed per-channel weights (ONNX Runtime's fast path on x86), 7-bit with
    `reduce_range` (for a CPU where 8-bit ones saturate: `int8_saturates`).
    TensorRT form: symmetric signed activations and weights (zero point 0), which TensorRT's explicit
    quantization requires, with float biases (TensorRT fuses them itself). This form runs about 3x
    slower in ONNX Runtime on this CPU, so it is checked here and built into plans on a GPU.
    """
    input_name = onnx.load(str(fp32_path), load_external_data=False).graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="anytime-quant-") as tmp:
        pre = preprocess(fp32_path, Path(tmp) / "pre.onnx")
        quiet = logging.getLogger().level
        logging.getLogger().setLevel(logging.ERROR)  # ORT logs one warning per tensor at WARNING
        try:
            # ORT's calibrators also print their progress ("Collecting tensor data ...") to stdout.
            with contextlib.redirect_stdout(io.StringIO()):
                quantize_static(
                    str(pre),
                    str(cpu_path),
                    OrtCalibrationReader(calib, input_name),
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=method.ort,
                    calibration_cache_path=cache_path,
                    reduce_range=reduce_range,
                )
                if trt_path is not None:
                    quantize_static(
                        str(pre),
                        str(trt_path),
                        None,
                        quant_format=QuantFormat.QDQ,
                        per_channel=True,
                        activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8,
                        calibrate_method=method.ort,
                        calibration_cache_path=cache_path,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
                    )
        finally:
            logging.getLogger().setLevel(quiet)
    if trt_path is not None:
        check_tensorrt_form(trt_path)


def check_tensorrt_form(path: Path) -> int:
    """Every QuantizeLinear/DequantizeLinear has int8 zero points equal to 0; returns how many Q/DQ nodes."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    qdq = [n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if not qdq:
        raise QuantizationError(f"{path}: no Q/DQ nodes; not a quantized graph")
    for node in qdq:
        if len(node.input) < 3 or node.input[2] not in inits:
            raise QuantizationError(f"{path}: {node.name} has no constant zero point")
        zp = inits[node.input[2]]
        if zp.data_type != onnx.TensorProto.INT8 or numpy_helper.to_array(zp).any():
            raise QuantizationError(f"{path}: {node.name} zero point is not symmetric int8 (TensorRT needs 0)")
    return len(qdq)
