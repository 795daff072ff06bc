"""TensorRT plan building (offline): a plan from an ONNX file, its sidecar of what it was built from and for, and
the timing cache that later builds on the same GPU and TensorRT version start from.

Runs only on a machine with TensorRT (8.6 or 10.x) and an NVIDIA GPU; elsewhere it raises `BackendUnavailable`
before touching the ONNX file's contents. FP16 is a builder flag on the FP32 file; INT8 comes from the
symmetric QDQ file on TensorRT 10, and from the FP32 file through an entropy calibrator on 8.x
(engines/steps/int8_calibrator.py). The runtime side is engines/backends/tensorrt.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from engines.backends.cuda import Device
from engines.backends.tensorrt import require_gpu, sidecar_path, tensorrt_version, trt_logger
from engines.base import ArtifactError, BackendUnavailable, Precision, sha256_file
from engines.steps.int8_calibrator import Int8Calibration, entropy_calibrator

SUPPORTED_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.INT8)
QDQ_FROM = (10, 0)  # TensorRT versions from this one on build INT8 from QDQ files; older ones calibrate


def int8_method(trt_version: tuple[int, int]) -> str:
    """How INT8 plans are made with this TensorRT version: "qdq" (explicit) or "entropy_calibrator" (implicit)."""
    return "qdq" if trt_version >= QDQ_FROM else "entropy_calibrator"


def _write_atomic(path: Path, data: bytes) -> None:
    # A crash mid-write must not leave a truncated plan that looks like a finished one.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _check_int8_onnx(onnx_path: Path) -> None:
    """Refuse an ONNX file that is not an explicitly quantized (QDQ) model TensorRT can take."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    quantize_nodes = [node for node in model.graph.node if node.op_type == "QuantizeLinear"]
    if not quantize_nodes:
        # TensorRT's implicit INT8 calibrators are deprecated since 10.1: from 10 on, only QDQ models.
        raise ValueError(
            f"{onnx_path} has no QuantizeLinear nodes: INT8 plans are built only from a QDQ model "
            "(explicit quantization); calibrate it first"
        )
    initializers = {init.name: init for init in model.graph.initializer}
    for node in quantize_nodes:
        zero_point = initializers.get(node.input[2]) if len(node.input) > 2 else None
        if zero_point is not None and zero_point.data_type == onnx.TensorProto.UINT8:
            # ONNX Runtime's default CPU form; TensorRT wants symmetric signed int8 with zero point 0.
            raise ValueError(
                f"{onnx_path} quantizes to uint8 (node {node.name!r}): TensorRT needs the symmetric signed "
                "int8 QDQ file"
            )


def _profile_batches(batch_sizes: tuple[int, ...]) -> tuple[int, int, int]:
    """(min, opt, max) batch for the single optimisation profile.

    TensorRT tunes its kernels for `opt` and only guarantees the others run. The median of the batch sizes
    we serve (8 of 1/8/32) sits between the latency-bound batch 1 and the throughput-bound batch 32, so
    neither end is far from the shape the kernels were timed on.
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    return sizes[0], sizes[(len(sizes) - 1) // 2], sizes[-1]


def _set_precision_flags(trt: ModuleType, config: Any, precision: Precision) -> None:
    flags = trt.BuilderFlag
    if precision is Precision.FP32:
        # TF32 is on by default and rounds matmul inputs to 10 mantissa bits; the FP32 rung is the
        # accuracy reference of the ladder, so it must be real FP32. FP16 is the fast rung.
        if hasattr(flags, "TF32"):
            config.clear_flag(flags.TF32)
    elif precision is Precision.FP16:
        if not hasattr(flags, "FP16"):
            # TensorRT 11 removed the weak-typing flags: FP16 would need an FP16-typed (AutoCast) ONNX.
            raise BackendUnavailable(f"tensorrt {trt.__version__} has no FP16 builder flag; FP16 plans need 8.6-10.x")
        config.set_flag(flags.FP16)
    elif hasattr(flags, "INT8"):
        # A QDQ model (TensorRT 10) still needs the INT8 flag for its Q/DQ layers to build, and the calibrator
        # (8.x) needs it to run; FP16 lets the layers left in float run in half precision instead of FP32.
        config.set_flag(flags.INT8)
        config.set_flag(flags.FP16)
    # INT8 on TensorRT 11: no precision flags exist; networks are strongly typed and the Q/DQ nodes decide.


def _create_network(trt: ModuleType, builder: Any) -> Any:
    if tensorrt_version(trt) >= (10, 0):
        return builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    return builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))


def _use_timing_cache(config: Any, path: Path | None) -> None:
    """Start from the timing cache at `path` (kernel timings of earlier builds on this GPU and version)."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, False):  # False: refuse a cache from another device or version
        raise ArtifactError(f"TensorRT refused the timing cache {path}: delete it and build again")


def _use_calibrator(
    trt: ModuleType,
    config: Any,
    builder: Any,
    device: Device,
    name: str,
    item_shape: tuple[int, ...],
    calib: Int8Calibration,
) -> Any:
    """Set the entropy calibrator and its one-shape profile (calibration runs at a fixed batch)."""
    calibrator = entropy_calibrator(trt, calib, device, item_shape)
    shape = (calib.data.batch_size, *item_shape)
    profile = builder.create_optimization_profile()
    profile.set_shape(name, shape, shape, shape)
    config.set_calibration_profile(profile)
    config.int8_calibrator = calibrator
    return calibrator  # kept alive by the caller until the build is done


def _int8_source(onnx_path: Path, trt: ModuleType, calibration: Int8Calibration | None) -> str:
    method = int8_method(tensorrt_version(trt))
    if method == "qdq":
        _check_int8_onnx(onnx_path)
        if calibration is not None:
            raise ValueError(f"tensorrt {trt.__version__} builds INT8 from the QDQ file; it takes no calibration data")
    elif calibration is None:
        raise ValueError(f"tensorrt {trt.__version__} builds INT8 through a calibrator: calibration data is needed")
    return method


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    precision: Precision,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    workspace_bytes: int = 1 << 30,
    timing_cache: Path | None = None,
    calibration: Int8Calibration | None = None,
) -> Path:
    """Build a TensorRT plan for batches min(batch_sizes)..max(batch_sizes), write it and its sidecar.

    INT8: from a symmetric QDQ `onnx_path` on TensorRT 10, from an FP32 one and `calibration` on 8.x.
    `timing_cache` is read (when it exists) and written back with this build's kernel timings.
    """
    onnx_path, plan_path, precision = Path(onnx_path), Path(plan_path), Precision(precision)
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"TensorRT plans are built in {', '.join(SUPPORTED_PRECISIONS)}, not {precision}")
    batch_min, batch_opt, batch_max = _profile_batches(batch_sizes)
    if not onnx_path.is_file():
        raise ArtifactError(f"missing ONNX file {onnx_path}")
    trt, device = require_gpu()
    int8 = _int8_source(onnx_path, trt, calibration) if precision is Precision.INT8 else None

    onnx_sha256 = sha256_file(onnx_path)  # of the bytes TensorRT is about to parse
    builder = trt.Builder(trt_logger())
    network = _create_network(trt, builder)
    parser = trt.OnnxParser(network, trt_logger())
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")

    if network.num_inputs != 1:
        raise ValueError(f"{onnx_path} has {network.num_inputs} inputs, expected one")
    net_input = network.get_input(0)
    shape = tuple(net_input.shape)
    if shape[0] != -1 or any(d < 1 for d in shape[1:]):
        raise ValueError(f"{onnx_path} input {net_input.name!r} has shape {shape}: need a dynamic batch axis only")
    item_shape = tuple(int(d) for d in shape[1:])
    output_names = [network.get_output(i).name for i in range(network.num_outputs)]

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    _set_precision_flags(trt, config, precision)
    _use_timing_cache(config, timing_cache)
    profile = builder.create_optimization_profile()
    profile.set_shape(net_input.name, (batch_min, *item_shape), (batch_opt, *item_shape), (batch_max, *item_shape))
    config.add_optimization_profile(profile)
    calibrator = None
    if int8 == "entropy_calibrator" and calibration is not None:
        calibrator = _use_calibrator(trt, config, builder, device, net_input.name, item_shape, calibration)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build a {precision} plan from {onnx_path} (its log is on stderr)")
    del calibrator
    _write_atomic(plan_path, bytes(serialized))
    if timing_cache is not None:
        _write_atomic(timing_cache, bytes(config.get_timing_cache().serialize()))

    info = device.info()
    meta = {
        "tensorrt_version": str(trt.__version__),
        "gpu_name": info.gpu_name,
        "compute_capability": info.compute_capability,
        "cuda_version": info.cuda_version,
        "onnx_sha256": onnx_sha256,
        "onnx_file": onnx_path.name,
        "precision": str(precision),
        "int8": int8,
        "batch_sizes": sorted(set(batch_sizes)),
        "profile": {"min": batch_min, "opt": batch_opt, "max": batch_max},
        "input_name": net_input.name,
        "input_shape": list(item_shape),
        "output_names": output_names,
    }
    _write_atomic(sidecar_path(plan_path), (json.dumps(meta, indent=2) + "\n").encode())
    return plan_path
