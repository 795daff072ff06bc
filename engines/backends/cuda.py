"""The CUDA side of the TensorRT backend, through torch: the device, one stream, buffers and event timing.

torch is the CUDA binding every machine that builds plans has anyway (JetPack's own wheel on Jetson, the
CUDA wheel in the GPU image), so no pycuda or cuda-python is needed. `open_device` is the one door to the
GPU: it is called only where a plan is built or loaded, so this module imports on a CPU-only machine
(tests/fakes/gpu.py substitutes it, with `tensorrt`, to run the whole TensorRT path on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.base import BackendUnavailable


@dataclass(frozen=True)
class DeviceInfo:
    """What a plan is tied to, recorded beside it: the GPU model and the CUDA runtime."""

    gpu_name: str
    compute_capability: str  # "8.7": major.minor
    cuda_version: str  # the CUDA runtime torch was built with


class Buffer:
    """One tensor's memory, allocated once at the largest shape it will hold: on the device, and pinned on the
    host so that copies are asynchronous on the stream. Only the batch axis varies, so a batch of n occupies
    the first n rows, contiguously."""

    def __init__(self, torch: Any, device: Any, stream: Any, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.dtype = np.dtype(dtype)
        tdtype = torch.from_numpy(np.empty(0, self.dtype)).dtype
        self._torch, self._stream = torch, stream
        self._device = torch.empty(math.prod(shape), dtype=tdtype, device=device)
        self._host = torch.empty(math.prod(shape), dtype=tdtype, pin_memory=True)
        self._host_view = self._host.numpy()
        self.ptr: int = self._device.data_ptr()

    def upload(self, x: np.ndarray) -> None:
        """Queue a copy of `x` into the first x.size elements (on the stream; `x` may be reused at once)."""
        n = x.size
        self._host_view[:n] = x.reshape(-1)
        with self._torch.cuda.stream(self._stream):
            self._device[:n].copy_(self._host[:n], non_blocking=True)

    def download(self, shape: tuple[int, ...]) -> None:
        """Queue a copy of the first prod(shape) elements back to pinned host memory."""
        n = math.prod(shape)
        with self._torch.cuda.stream(self._stream):
            self._host[:n].copy_(self._device[:n], non_blocking=True)

    def host(self, shape: tuple[int, ...]) -> np.ndarray:
        """A copy of what `download` brought back (call after the stream is synchronized)."""
        return self._host_view[: math.prod(shape)].reshape(shape).copy()


class Event:
    def __init__(self, torch: Any, stream: Any) -> None:
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record(stream)

    def elapsed_ms(self, end: Event) -> float:
        """GPU time between this event and `end` (both recorded, the stream synchronized)."""
        return float(self._event.elapsed_time(end._event))


class Device:
    """The current CUDA device and one stream on it: an engine's copies and its execution are ordered on it."""

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise BackendUnavailable(
                "torch is not installed: the TensorRT backend's CUDA buffers come from torch"
            ) from e
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "no CUDA device: TensorRT needs an NVIDIA GPU, its driver and a CUDA build of torch"
            )
        self._torch = torch
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)

    def info(self) -> DeviceInfo:
        major, minor = self._torch.cuda.get_device_capability(self._device)
        return DeviceInfo(
            gpu_name=self._torch.cuda.get_device_name(self._device),
            compute_capability=f"{major}.{minor}",
            cuda_version=str(self._torch.version.cuda),
        )

    @property
    def stream_handle(self) -> int:
        """The cudaStream_t that TensorRT enqueues on."""
        return int(self._stream.cuda_stream)

    def buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Buffer:
        return Buffer(self._torch, self._device, self._stream, shape, dtype)

    def event(self) -> Event:
        """An event recorded on the stream now (for timing what is queued between two of them)."""
        return Event(self._torch, self._stream)

    def synchronize(self) -> None:
        self._stream.synchronize()


def open_device() -> Device:
    """The GPU, or BackendUnavailable saying why there is none."""
    return Device()
