"""TensorRT (8.6 or 10.x) backend: run a plan on an NVIDIA GPU (plans are built by engines/steps/plans.py).

`tensorrt` and CUDA are touched only inside functions, so this module imports on a CPU-only machine;
there every entry point raises `BackendUnavailable`. The CUDA calls (buffers, stream, events) go through
engines/backends/cuda.py.

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
from typing import Any

import numpy as np

from engines.backends import cuda
from engines.base import (
    ArtifactError,
    Backend,
    BackendUnavailable,
    EngineBase,
    Precision,
    verify_artifact,
)

# JetPack 6.0 ships TensorRT 8.6 (INT8 through its calibrator); 6.1 and later, and the GPU image, 10.x.
MIN_TENSORRT = (8, 6)


def tensorrt_version(trt: ModuleType) -> tuple[int, int]:
    major, minor = str(trt.__version__).split(".")[:2]
    return int(major), int(minor)


def require_tensorrt() -> ModuleType:
    """Import tensorrt, or say why this machine cannot build or run plans."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as e:
        raise BackendUnavailable(
            "tensorrt is not installed (pip install 'anytime[gpu]' on a machine with an NVIDIA GPU; "
            "on Jetson it comes with JetPack)"
        ) from e
    if tensorrt_version(trt) < MIN_TENSORRT:
        need = ".".join(map(str, MIN_TENSORRT))
        raise BackendUnavailable(f"tensorrt {trt.__version__} is too old: need >= {need}")
    return trt


def require_gpu() -> tuple[ModuleType, cuda.Device]:
    """TensorRT and a CUDA device, or BackendUnavailable naming what is missing."""
    trt = require_tensorrt()
    return trt, cuda.open_device()


@functools.cache
def trt_logger() -> Any:
    # TensorRT keeps one process-wide logger: builders and runtimes given different ones warn, and the
    # logger must outlive them all.
    trt = importlib.import_module("tensorrt")
    return trt.Logger(trt.Logger.WARNING)


def sidecar_path(plan_path: Path) -> Path:
    """Where the plan step records what a plan was built from and for."""
    return plan_path.with_suffix(".json")


def read_sidecar(plan_path: Path) -> dict[str, Any]:
    path = sidecar_path(plan_path)
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ArtifactError(f"{plan_path} has no sidecar {path}: rebuild the plan with build_plan") from e
    except json.JSONDecodeError as e:
        raise ArtifactError(f"sidecar {path} is not valid JSON: {e}") from e
    return meta


def check_compatible(plan_path: Path, meta: dict[str, Any], trt_version: str, device: cuda.DeviceInfo) -> None:
    """Refuse a plan built by another TensorRT version or for another GPU model.

    Plans are not portable: elsewhere they either fail to load or run kernels tuned for other hardware,
    and the ladder's latency profiles would be wrong. The CUDA version is recorded, not checked: a plan
    runs on any CUDA runtime its TensorRT version supports.
    """
    if meta.get("tensorrt_version") != trt_version:
        raise ArtifactError(f"{plan_path} was built by TensorRT {meta.get('tensorrt_version')}, this is {trt_version}")
    if meta.get("gpu_name") != device.gpu_name or meta.get("compute_capability") != device.compute_capability:
        raise ArtifactError(
            f"{plan_path} was built for {meta.get('gpu_name')} (compute capability {meta.get('compute_capability')}), "
            f"this GPU is {device.gpu_name} ({device.compute_capability})"
        )


def _numpy_dtype(trt: ModuleType, dtype: Any) -> np.dtype[Any]:
    names = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32}
    for name, np_dtype in {**names, "INT64": np.int64, "BOOL": np.bool_}.items():
        if getattr(trt.DataType, name, None) == dtype:  # INT64 exists from TensorRT 9 on
            return np.dtype(np_dtype)
    raise TypeError(f"no numpy dtype for TensorRT tensor type {dtype}")


class TensorRTEngine(EngineBase):
    """A deserialized plan with one execution context on one CUDA stream; `run` is serialized by a lock.

    Device memory is allocated once, at the profile's largest batch, for every input and output, and the
    context keeps those addresses; a batch of n uses the first n rows. `run` blocks its thread (the
    scheduler's worker) on the stream, never the event loop: the engine is not `concurrent`, so the
    scheduler never runs it inline.
    """

    backend = Backend.TENSORRT

    def __init__(self, plan_path: Path, onnx_sha256: str | None = None, sha256: str | None = None) -> None:
        plan_path = Path(plan_path)
        verify_artifact(plan_path, sha256)
        meta = read_sidecar(plan_path)
        trt, device = require_gpu()
        check_compatible(plan_path, meta, str(trt.__version__), device.info())
        if onnx_sha256 is not None and meta.get("onnx_sha256") != onnx_sha256:
            raise ArtifactError(f"{plan_path} was built from another ONNX file than the one the manifest names")

        self.path = plan_path
        self.precision = Precision(meta["precision"])
        self._lock = threading.Lock()
        self._device = device
        self._runtime = trt.Runtime(trt_logger())
        self._engine = self._runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self._engine is None:
            raise ArtifactError(f"TensorRT could not deserialize {plan_path} (its log is on stderr)")
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise RuntimeError(f"TensorRT could not create an execution context for {plan_path}")

        engine = self._engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(inputs) != 1:
            raise ArtifactError(f"{plan_path} has inputs {inputs}, expected one")
        # The sidecar keeps the ONNX graph's output order, which `run` promises; the engine's IO order is
        # not documented to match it.
        if sorted(meta["output_names"]) != sorted(outputs):
            raise ArtifactError(f"{plan_path} outputs {outputs} differ from its sidecar's {meta['output_names']}")
        self.input_name = inputs[0]
        self.output_names = list(meta["output_names"])
        self.input_shape = tuple(int(d) for d in engine.get_tensor_shape(self.input_name))[1:]
        min_shape, _, max_shape = engine.get_tensor_profile_shape(self.input_name, 0)
        self.min_batch, self.max_batch = int(min_shape[0]), int(max_shape[0])

        # Buffers at the largest batch: the output shapes follow from the input shape.
        if not self._context.set_input_shape(self.input_name, (self.max_batch, *self.input_shape)):
            raise ArtifactError(f"{plan_path}: TensorRT refused its own profile's largest batch {self.max_batch}")
        self._buffers = {
            name: device.buffer(
                tuple(int(d) for d in self._context.get_tensor_shape(name)),
                _numpy_dtype(trt, engine.get_tensor_dtype(name)),
            )
            for name in names
        }
        for name, buffer in self._buffers.items():
            if not self._context.set_tensor_address(name, buffer.ptr):
                raise RuntimeError(f"TensorRT refused the address of {name} in {plan_path}")

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        return self._execute(x, timed=False)[0]

    def run_timed(self, x: np.ndarray) -> tuple[list[np.ndarray], float]:
        """`run`, and the GPU time (ms) from the copy in to the copy out, taken with CUDA events on the stream."""
        outputs, ms = self._execute(x, timed=True)
        assert ms is not None
        return outputs, ms

    def _execute(self, x: np.ndarray, timed: bool) -> tuple[list[np.ndarray], float | None]:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[1:] != self.input_shape:
            item = ", ".join(map(str, self.input_shape))
            raise ValueError(f"expected a batch of shape (N, {item}), got {x.shape}")
        if not self.min_batch <= x.shape[0] <= self.max_batch:
            raise ValueError(f"batch {x.shape[0]} is outside this plan's profile {self.min_batch}..{self.max_batch}")
        with self._lock:
            context = self._context
            if context is None:
                raise RuntimeError(f"{self!r} is closed")
            if not context.set_input_shape(self.input_name, tuple(x.shape)):
                raise ValueError(f"TensorRT rejected input shape {x.shape}")
            shapes = {name: tuple(int(d) for d in context.get_tensor_shape(name)) for name in self.output_names}
            start = self._device.event() if timed else None
            # Copy in, execute and copy out are queued on one stream, so they run in order without waits.
            inp = self._buffers[self.input_name]
            inp.upload(x.astype(inp.dtype, copy=False))
            if not context.execute_async_v3(self._device.stream_handle):
                raise RuntimeError(f"TensorRT failed to execute {self.path} (its log is on stderr)")
            for name in self.output_names:
                self._buffers[name].download(shapes[name])
            end = self._device.event() if timed else None
            self._device.synchronize()
            outputs = [
                self._buffers[name].host(shapes[name]).astype(np.float32, copy=False) for name in self.output_names
            ]
            ms = start.elapsed_ms(end) if start is not None and end is not None else None
            return outputs, ms

    def close(self) -> None:
        # The context must go before the engine, and the engine before the runtime that deserialized it.
        with self._lock:
            self._context = None
            self._engine = None
            self._runtime = None
            self._buffers = {}
