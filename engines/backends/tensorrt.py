"""TensorRT (>= 10) backend: run a plan on an NVIDIA GPU (plans are built by engines/steps/plans.py).

`tensorrt` and CUDA are touched only inside functions, so this module imports on a CPU-only machine;
there every entry point raises `BackendUnavailable`. Device buffers are torch CUDA tensors, so no
pycuda / cuda-python is needed.

A plan only runs on the TensorRT version and the GPU model that built it, so the plan step writes a sidecar
JSON next to the plan, and `TensorRTEngine` refuses a plan whose sidecar names another version or GPU.
"""

from __future__ import annotations

import functools
import importlib
import json
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
    verify_artifact,
)

if TYPE_CHECKING:
    import torch

MIN_TENSORRT_MAJOR = 10


def require_tensorrt() -> ModuleType:
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
def trt_logger() -> Any:
    # TensorRT keeps one process-wide logger: builders and runtimes given different ones warn, and the
    # logger must outlive them all.
    trt = importlib.import_module("tensorrt")
    return trt.Logger(trt.Logger.WARNING)


def sidecar_path(plan_path: Path) -> Path:
    """Where the plan step records what a plan was built from and for."""
    return plan_path.with_suffix(".json")


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
        trt = require_tensorrt()
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
        self._runtime = trt.Runtime(trt_logger())
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
