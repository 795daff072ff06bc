"""Tiny ONNX graphs built with onnx.helper, for the backend tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibration.data import CalibrationSet
from engines.steps.int8_calibrator import Int8Calibration
from models.data import Split
from models.preprocess import PreprocessSpec

ITEM_SHAPE = (1, 4, 4)


def tiny_graph(path: Path, quantized: bool = False) -> Path:
    """x[N,1,4,4] -> Conv(2 filters, 3x3, pad 1) -> Relu -> Flatten -> Gemm -> logits[N,3].

    With `quantized`, the input and the conv weights go through symmetric signed int8 Q/DQ, as the
    calibration step writes for TensorRT.
    """
    rng = np.random.default_rng(0)
    weight = (0.5 * rng.standard_normal((2, 1, 3, 3))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(2)).astype(np.float32)
    fc_weight = (0.2 * rng.standard_normal((3, 32))).astype(np.float32)
    fc_bias = (0.1 * rng.standard_normal(3)).astype(np.float32)
    initializers = [
        numpy_helper.from_array(bias, "conv_b"),
        numpy_helper.from_array(fc_weight, "fc_w"),
        numpy_helper.from_array(fc_bias, "fc_b"),
    ]
    nodes = []
    conv_x, conv_w = "x", "conv_w"
    if quantized:
        x_scale = np.array(1 / 127, np.float32)  # inputs lie in [0, 1)
        w_scale = np.array(np.abs(weight).max() / 127, np.float32)
        w_int8 = np.clip(np.round(weight / w_scale), -127, 127).astype(np.int8)
        initializers += [
            numpy_helper.from_array(x_scale, "x_scale"),
            numpy_helper.from_array(w_scale, "w_scale"),
            numpy_helper.from_array(np.array(0, np.int8), "zero_point"),
            numpy_helper.from_array(w_int8, "conv_w_int8"),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["x", "x_scale", "zero_point"], ["x_q"], name="x_q"),
            helper.make_node("DequantizeLinear", ["x_q", "x_scale", "zero_point"], ["x_dq"], name="x_dq"),
            helper.make_node("DequantizeLinear", ["conv_w_int8", "w_scale", "zero_point"], ["w_dq"], name="w_dq"),
        ]
        conv_x, conv_w = "x_dq", "w_dq"
    else:
        initializers.append(numpy_helper.from_array(weight, "conv_w"))
    nodes += [
        helper.make_node("Conv", [conv_x, conv_w, "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("Flatten", ["relu"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *ITEM_SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializers,
    )
    # IR 8 / opset 17: old enough for every TensorRT 10 parser.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tiny_calibration(directory: Path, samples: int = 40, batch: int = 10) -> Int8Calibration:
    """Calibration data for `tiny_graph` (random images, normalized as a model's would be) and a cache path."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (samples, *ITEM_SHAPE[1:]), dtype=np.uint8)
    split = Split("calib", images, np.zeros(samples, np.int64), np.arange(samples), "tiny")
    spec = PreprocessSpec(ITEM_SHAPE, "float32", (0.5,), (0.25,))
    return Int8Calibration(CalibrationSet(split, spec, samples, batch_size=batch), directory / "calib" / "tiny.cache")
