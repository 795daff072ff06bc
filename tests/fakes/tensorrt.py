"""A substitute for the `tensorrt` module on a CPU, for the wiring tests (tests/fakes/gpu.py installs it).

It follows the part of TensorRT's Python API this project calls (10.x, and 8.6 where `__version__` says so:
the explicit-batch network flag, the entropy calibrator) and checks what a real builder would refuse. Its
builder keeps the parsed ONNX file and what was asked of it (flags, profile, calibration) in the "plan";
its engine runs that ONNX file through ONNX Runtime, reading its input from and writing its outputs to the
addresses the context was given, which the substituted device (tests/fakes/gpu.py) backs with host memory.
Nothing here is fast or quantized: only the wiring around TensorRT is real.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

__version__ = "10.0.1"  # tests/fakes/gpu.py sets the version a test asks for

MAGIC = b"SUBSTITUTED-TENSORRT-PLAN\n"


class _Value:
    """An enum member of TensorRT's: compared by identity, with a bit number where TensorRT has one."""

    def __init__(self, name: str, bit: int = 0) -> None:
        self.name, self.bit = name, bit

    def __repr__(self) -> str:
        return self.name

    def __int__(self) -> int:
        return self.bit


class DataType:
    FLOAT, HALF, INT8, INT32 = _Value("FLOAT"), _Value("HALF"), _Value("INT8"), _Value("INT32")
    BOOL, UINT8, INT64 = _Value("BOOL"), _Value("UINT8"), _Value("INT64")


class TensorIOMode:
    INPUT, OUTPUT = _Value("INPUT"), _Value("OUTPUT")


class BuilderFlag:
    FP16, INT8, TF32 = _Value("FP16"), _Value("INT8"), _Value("TF32")


class MemoryPoolType:
    WORKSPACE = _Value("WORKSPACE")


class NetworkDefinitionCreationFlag:
    EXPLICIT_BATCH = _Value("EXPLICIT_BATCH", 0)


def _major() -> int:
    return int(__version__.split(".")[0])


class Logger:
    WARNING = _Value("WARNING")

    def __init__(self, severity: Any = None) -> None:
        self.severity = severity


class _Tensor:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape


class _Network:
    def __init__(self, flags: int) -> None:
        self.flags = flags
        self.onnx: bytes = b""
        self.inputs: list[_Tensor] = []
        self.outputs: list[_Tensor] = []

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, i: int) -> _Tensor:
        return self.inputs[i]

    def get_output(self, i: int) -> _Tensor:
        return self.outputs[i]


def _shape(value_info: Any) -> tuple[int, ...]:
    return tuple(d.dim_value if d.HasField("dim_value") else -1 for d in value_info.type.tensor_type.shape.dim)


class OnnxParser:
    def __init__(self, network: _Network, logger: Logger) -> None:
        self.network, self.errors = network, list[str]()

    def parse_from_file(self, path: str) -> bool:
        if _major() < 10 and not self.network.flags & 1:
            self.errors.append("the ONNX parser needs a network created with the EXPLICIT_BATCH flag")
            return False
        data = Path(path).read_bytes()
        model = onnx.load_from_string(data)
        initializers = {i.name for i in model.graph.initializer}
        self.network.onnx = data
        self.network.inputs = [_Tensor(i.name, _shape(i)) for i in model.graph.input if i.name not in initializers]
        self.network.outputs = [_Tensor(o.name, _shape(o)) for o in model.graph.output]
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, i: int) -> str:
        return self.errors[i]


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

    def set_shape(self, name: str, low: Any, opt: Any, high: Any) -> None:
        self.shapes[name] = (tuple(low), tuple(opt), tuple(high))


class _TimingCache:
    """Kernel timings by layer; here one entry per network and flags built with it."""

    def __init__(self, data: bytes) -> None:
        self.entries: list[str] = json.loads(data) if data else []

    def serialize(self) -> bytes:
        return json.dumps(self.entries).encode()


class IInt8EntropyCalibrator2:
    def __init__(self) -> None:
        pass


class _Config:
    def __init__(self) -> None:
        self.flags = {BuilderFlag.TF32.name}  # TF32 is on by default
        self.profiles: list[_Profile] = []
        self.calibration_profile: _Profile | None = None
        self.int8_calibrator: Any = None
        self.timing_cache: _TimingCache | None = None
        self.pool_limits: dict[str, int] = {}

    def set_flag(self, flag: _Value) -> None:
        self.flags.add(flag.name)

    def clear_flag(self, flag: _Value) -> None:
        self.flags.discard(flag.name)

    def set_memory_pool_limit(self, pool: _Value, size: int) -> None:
        self.pool_limits[pool.name] = size

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def set_calibration_profile(self, profile: _Profile) -> bool:
        self.calibration_profile = profile
        return True

    def create_timing_cache(self, data: bytes) -> _TimingCache:
        return _TimingCache(bytes(data))

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> _TimingCache | None:
        return self.timing_cache


def _read(ptr: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values at a "device" address (host memory from the substituted device)."""
    return np.ctypeslib.as_array((ctypes.c_float * math.prod(shape)).from_address(ptr)).reshape(shape).copy()


def _write(ptr: int, values: np.ndarray) -> None:
    np.ctypeslib.as_array((ctypes.c_float * values.size).from_address(ptr))[:] = values.astype(np.float32).ravel()


def _calibrate(config: _Config, name: str) -> dict[str, Any] | None:
    """What an implicit-INT8 build does with its calibrator: use its cache, or read every batch and write one."""
    calibrator, profile = config.int8_calibrator, config.calibration_profile
    if calibrator is None or profile is None or name not in profile.shapes:
        return None  # TensorRT stops: no dynamic ranges for an INT8 network
    cached = calibrator.read_calibration_cache()
    if cached:
        return {**json.loads(bytes(cached)), "from_cache": True}
    shape = profile.shapes[name][1]
    if shape[0] != calibrator.get_batch_size():
        return None
    batches, absmax = 0, 0.0
    while (pointers := calibrator.get_batch([name])) is not None:
        absmax = max(absmax, float(np.abs(_read(pointers[0], shape)).max()))
        batches += 1
    if batches == 0:
        return None
    result = {"batches": batches, "input_absmax": absmax}
    calibrator.write_calibration_cache(json.dumps(result).encode())
    return {**result, "from_cache": False}


class Builder:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int) -> _Network:
        return _Network(flags)

    def create_builder_config(self) -> _Config:
        return _Config()

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes | None:
        (net_input,) = network.inputs
        if len(config.profiles) != 1 or net_input.name not in config.profiles[0].shapes:
            return None  # a dynamic input needs a profile
        low, opt, high = config.profiles[0].shapes[net_input.name]
        if not low[0] <= opt[0] <= high[0] or not low[1:] == opt[1:] == high[1:] == net_input.shape[1:]:
            return None
        model = onnx.load_from_string(network.onnx)
        qdq = any(node.op_type == "QuantizeLinear" for node in model.graph.node)
        calibration = None
        if BuilderFlag.INT8.name in config.flags and not qdq:
            calibration = _calibrate(config, net_input.name)
            if calibration is None:
                return None
        if qdq and BuilderFlag.INT8.name not in config.flags:
            return None  # a weakly typed network builds Q/DQ layers only with the INT8 flag
        header = {
            "tensorrt_version": __version__,
            "flags": sorted(config.flags),
            "profile": {"min": low[0], "opt": opt[0], "max": high[0]},
            "item_shape": list(net_input.shape[1:]),
            "qdq": qdq,
            "calibration": calibration,
        }
        if config.timing_cache is not None:
            config.timing_cache.entries.append(hashlib.sha256(network.onnx + str(header).encode()).hexdigest()[:16])
        return MAGIC + json.dumps(header).encode() + b"\n" + network.onnx


def read_plan(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header (what the builder was asked) and the ONNX bytes of a substituted plan."""
    if not data.startswith(MAGIC):
        raise ValueError("not a substituted plan")
    header, onnx_bytes = data[len(MAGIC) :].split(b"\n", 1)
    return json.loads(header), onnx_bytes


class _Context:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self.input_shape: tuple[int, ...] | None = None
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: Any) -> bool:
        shape = tuple(int(d) for d in shape)
        low, _, high = self.engine.profile
        if name != self.engine.input_name or shape[1:] != low[1:] or not low[0] <= shape[0] <= high[0]:
            return False
        self.input_shape = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        batch = self.input_shape[0] if self.input_shape is not None else -1
        if name == self.engine.input_name:
            return (batch, *self.engine.profile[0][1:])
        return (batch, *self.engine.output_items[name])

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self.engine
        if self.input_shape is None or set(self.addresses) != {engine.input_name, *engine.output_names}:
            return False
        x = _read(self.addresses[engine.input_name], self.input_shape)
        outputs = engine.session.run(engine.output_names, {engine.input_name: x})
        for name, value in zip(engine.output_names, outputs, strict=True):
            _write(self.addresses[name], np.asarray(value))
        return True


class ICudaEngine:
    def __init__(self, header: dict[str, Any], onnx_bytes: bytes) -> None:
        self.header = header
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]
        item = tuple(header["item_shape"])
        profile = header["profile"]
        self.profile = tuple((profile[k], *item) for k in ("min", "opt", "max"))
        outputs = self.session.run(self.output_names, {self.input_name: np.zeros((1, *item), np.float32)})
        self.output_items = {n: tuple(np.asarray(o).shape[1:]) for n, o in zip(self.output_names, outputs, strict=True)}

    @property
    def num_io_tensors(self) -> int:
        return 1 + len(self.output_names)

    def get_tensor_name(self, i: int) -> str:
        return [self.input_name, *self.output_names][i]

    def get_tensor_mode(self, name: str) -> _Value:
        return TensorIOMode.INPUT if name == self.input_name else TensorIOMode.OUTPUT

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        item = self.profile[0][1:] if name == self.input_name else self.output_items[name]
        return (-1, *item)

    def get_tensor_dtype(self, name: str) -> _Value:
        return DataType.FLOAT

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> tuple[tuple[int, ...], ...]:
        return self.profile

    def create_execution_context(self) -> _Context:
        return _Context(self)


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes) -> ICudaEngine | None:
        try:
            header, onnx_bytes = read_plan(bytes(data))
        except ValueError:
            return None
        if header["tensorrt_version"] != __version__:
            return None  # TensorRT refuses a plan serialized by another version
        return ICudaEngine(header, onnx_bytes)
