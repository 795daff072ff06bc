"""TensorRT (>= 10) backend: build a plan from an ONNX file, and run it on an NVIDIA GPU.

`tensorrt` and CUDA are touched only inside functions, so this module imports on a CPU-only machine;
there every entry point raises `BackendUnavailable`. Device buffers are torch CUDA tensors, so no
pycuda / cuda-python is needed.

A plan only runs on the TensorRT version and the GPU model that built it, so `build_plan` writes a sidecar
JSON next to the plan, and `TensorRTEngine` refuses a plan whose sidecar names another version or GPU.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.base import (
    ArtifactError,
    Backend,
    BackendUnavailable,
    EngineBase,
    Precision,
    sha256_file,
    verify_artifact,
)

if TYPE_CHECKING:
    import torch

MIN_TENSORRT_MAJOR = 10
SUPPORTED_PRECISIONS = (Precision.FP32, Precision.FP16, Precision.INT8)


def _require_tensorrt() -> ModuleType:
    """Import tensorrt, or say why this machine cannot build or run plans."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendUnavailable(
            "tensorrt is not installed (pip install 'anytime[gpu]' on a machine with an NVIDIA GPU)"
        ) from e
    major = int(str(trt.__version__).split(".")[0])
    if major < MIN_TENSORRT_MAJOR:
        raise BackendUnavailable(f"tensorrt {trt.__version__} is too old: need >= {MIN_TENSORRT_MAJOR}")
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("no CUDA device: TensorRT needs an NVIDIA GPU and a CUDA build of torch")
    return trt


@functools.cache
def _logger() -> Any:
    # TensorRT keeps one process-wide logger: builders and runtimes given different ones warn, and the
    # logger must outlive them all.
    trt = importlib.import_module("tensorrt")
    return trt.Logger(trt.Logger.WARNING)


def sidecar_path(plan_path: Path) -> Path:
    """Where `build_plan` records what a plan was built from and for."""
    return plan_path.with_suffix(".json")


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
        # TensorRT's implicit INT8 calibrators are deprecated since 10.1; we only build from QDQ models.
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
            raise BackendUnavailable(f"tensorrt {trt.__version__} has no FP16 builder flag; FP16 plans need 10.x")
        config.set_flag(flags.FP16)
    elif hasattr(flags, "INT8"):  # INT8 on TensorRT 10
        # The network is weakly typed, and a QDQ model still needs the INT8 flag for its Q/DQ layers to
        # build; FP16 lets the layers outside Q/DQ pairs run in half precision instead of FP32.
        config.set_flag(flags.INT8)
        config.set_flag(flags.FP16)
    # INT8 on TensorRT 11: no precision flags exist; networks are strongly typed and the Q/DQ nodes decide.


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    precision: Precision,
    batch_sizes: tuple[int, ...] = (1, 8, 32),
    workspace_bytes: int = 1 << 30,
) -> Path:
    """Build a TensorRT plan for batches min(batch_sizes)..max(batch_sizes), write it and its sidecar."""
    onnx_path, plan_path, precision = Path(onnx_path), Path(plan_path), Precision(precision)
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"TensorRT plans are built in {', '.join(SUPPORTED_PRECISIONS)}, not {precision}")
    batch_min, batch_opt, batch_max = _profile_batches(batch_sizes)
    if not onnx_path.is_file():
        raise ArtifactError(f"missing ONNX file {onnx_path}")
    if precision is Precision.INT8:
        _check_int8_onnx(onnx_path)
    trt = _require_tensorrt()
    import torch

    onnx_sha256 = sha256_file(onnx_path)  # of the bytes TensorRT is about to parse
    builder = trt.Builder(_logger())
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, _logger())
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")

    if network.num_inputs != 1:
        raise ValueError(f"{onnx_path} has {network.num_inputs} inputs, expected one")
    net_input = network.get_input(0)
    shape = tuple(net_input.shape)
    if shape[0] != -1 or any(d < 1 for d in shape[1:]):
        raise ValueError(f"{onnx_path} input {net_input.name!r} has shape {shape}: need a dynamic batch axis only")
    item_shape = shape[1:]
    output_names = [network.get_output(i).name for i in range(network.num_outputs)]

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    _set_precision_flags(trt, config, precision)
    profile = builder.create_optimization_profile()
    profile.set_shape(net_input.name, (batch_min, *item_shape), (batch_opt, *item_shape), (batch_max, *item_shape))
    config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build a {precision} plan from {onnx_path} (its log is on stderr)")
    _write_atomic(plan_path, bytes(serialized))

    major, minor = torch.cuda.get_device_capability()
    meta = {
        "tensorrt_version": trt.__version__,
        "gpu_name": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "onnx_sha256": onnx_sha256,
        "precision": str(precision),
        "batch_sizes": sorted(set(batch_sizes)),
        "profile": {"min": batch_min, "opt": batch_opt, "max": batch_max},
        "input_name": net_input.name,
        "input_shape": list(item_shape),
        "output_names": output_names,
    }
    _write_atomic(sidecar_path(plan_path), (json.dumps(meta, indent=2) + "\n").encode())
    return plan_path


def _read_sidecar(plan_path: Path) -> dict[str, Any]:
    path = sidecar_path(plan_path)
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ArtifactError(f"{plan_path} has no sidecar {path}: rebuild the plan with build_plan") from e
    except json.JSONDecodeError as e:
        raise ArtifactError(f"sidecar {path} is not valid JSON: {e}") from e
    return meta


def _torch_dtype(trt: ModuleType, dtype: Any) -> torch.dtype:
    import torch

    dtypes = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT8: torch.int8,
        trt.DataType.UINT8: torch.uint8,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.BOOL: torch.bool,
    }
    if dtype not in dtypes:
        raise TypeError(f"no torch dtype for TensorRT tensor type {dtype}")
    return dtypes[dtype]


class TensorRTEngine(EngineBase):
    """A deserialized plan with one execution context; `run` is serialized by a lock."""

    backend = Backend.TENSORRT

    def __init__(self, plan_path: Path, onnx_sha256: str | None = None, sha256: str | None = None) -> None:
        plan_path = Path(plan_path)
        verify_artifact(plan_path, sha256)
        meta = _read_sidecar(plan_path)
        trt = _require_tensorrt()
        import torch

        # Plans are not portable: another TensorRT version or GPU model either fails to load or runs
        # kernels tuned for different hardware, so refuse rather than serve wrong latency profiles.
        if meta.get("tensorrt_version") != trt.__version__:
            raise ArtifactError(
                f"{plan_path} was built by TensorRT {meta.get('tensorrt_version')}, this is {trt.__version__}"
            )
        gpu_name = torch.cuda.get_device_name()
        if meta.get("gpu_name") != gpu_name:
            raise ArtifactError(f"{plan_path} was built for {meta.get('gpu_name')}, this GPU is {gpu_name}")
        if onnx_sha256 is not None and meta.get("onnx_sha256") != onnx_sha256:
            raise ArtifactError(f"{plan_path} was built from another ONNX file than the one the manifest names")

        self.path = plan_path
        self.precision = Precision(meta["precision"])
        self._lock = threading.Lock()
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)
        self._runtime = trt.Runtime(_logger())
        self._engine = self._runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self._engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {plan_path} (its log is on stderr)")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise RuntimeError(f"TensorRT could not create an execution context for {plan_path}")

        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(inputs) != 1:
            raise ArtifactError(f"{plan_path} has inputs {inputs}, expected one")
        # The sidecar keeps the ONNX graph's output order, which `run` promises; the engine's IO order is
        # not documented to match it.
        if sorted(meta["output_names"]) != sorted(outputs):
            raise ArtifactError(f"{plan_path} outputs {outputs} differ from its sidecar's {meta['output_names']}")
        self.input_name = inputs[0]
        self.output_names = list(meta["output_names"])
        self.input_shape = tuple(self._engine.get_tensor_shape(self.input_name))[1:]
        min_shape, _, max_shape = self._engine.get_tensor_profile_shape(self.input_name, 0)
        self.min_batch, self.max_batch = int(min_shape[0]), int(max_shape[0])
        self._dtypes = {name: _torch_dtype(trt, self._engine.get_tensor_dtype(name)) for name in names}

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        import torch

        x = np.ascontiguousarray(x, dtype=np.float32)
        if not x.flags.writeable:
            x = x.copy()  # torch.from_numpy warns on read-only arrays
        if x.shape[1:] != self.input_shape:
            item = ", ".join(map(str, self.input_shape))
            raise ValueError(f"expected a batch of shape (N, {item}), got {x.shape}")
        if not self.min_batch <= x.shape[0] <= self.max_batch:
            raise ValueError(f"batch {x.shape[0]} is outside this plan's profile {self.min_batch}..{self.max_batch}")
        with self._lock:
            context = self._context
            if context is None:
                raise RuntimeError(f"{self!r} is closed")
            # Every copy, allocation and the execution go on one stream, so they are ordered without events.
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                batch = torch.from_numpy(x).to(device=self._device, dtype=self._dtypes[self.input_name])
                if not context.set_input_shape(self.input_name, tuple(x.shape)):
                    raise ValueError(f"TensorRT rejected input shape {x.shape}")
                context.set_tensor_address(self.input_name, batch.data_ptr())
                outputs = []
                for name in self.output_names:
                    shape = tuple(context.get_tensor_shape(name))
                    out = torch.empty(shape, dtype=self._dtypes[name], device=self._device)
                    context.set_tensor_address(name, out.data_ptr())
                    outputs.append(out)
                if not context.execute_async_v3(self._stream.cuda_stream):
                    raise RuntimeError(f"TensorRT failed to execute {self.path} (its log is on stderr)")
                self._stream.synchronize()
                return [out.float().cpu().numpy() for out in outputs]

    def close(self) -> None:
        # The context must go before the engine, and the engine before the runtime that deserialized it.
        with self._lock:
            self._context = None
            self._engine = None
            self._runtime = None
