"""The TensorRT and CUDA calls substituted, everything else real: for wiring tests on a CPU-only machine.

`substitute()` puts tests/fakes/tensorrt.py in place of the `tensorrt` module and a host-memory device in
place of engines/backends/cuda.py's `open_device`. Run as a program, it does that and then runs the
`anytime` command line, so a test can start `anytime build --backend tensorrt` or `anytime serve` in a
process of its own:

    python -m tests.fakes.gpu [--tensorrt-version V] [--gpu-name NAME] [--without-cuda] -- build ...
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import engines.backends.cuda
import engines.backends.tensorrt
import tests.fakes.tensorrt as fake_tensorrt
from engines.backends.cuda import DeviceInfo

GPU_NAME = "Substituted GPU (host memory)"


class FakeBuffer:
    """ "Device" memory that is host memory, so that the substituted engine can read and write it by address."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.dtype = np.dtype(dtype)
        self._device = np.zeros(math.prod(shape), self.dtype)
        self._host = np.zeros(math.prod(shape), self.dtype)
        self.ptr = int(self._device.ctypes.data)

    def upload(self, x: np.ndarray) -> None:
        self._device[: x.size] = x.reshape(-1)

    def download(self, shape: tuple[int, ...]) -> None:
        n = math.prod(shape)
        self._host[:n] = self._device[:n]

    def host(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._host[: math.prod(shape)].reshape(shape).copy()


class FakeEvent:
    def __init__(self) -> None:
        self.at = time.perf_counter()

    def elapsed_ms(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3


class FakeDevice:
    stream_handle = 0

    def __init__(self, gpu_name: str = GPU_NAME, compute_capability: str = "8.7", cuda_version: str = "12.6") -> None:
        self._info = DeviceInfo(gpu_name, compute_capability, cuda_version)
        self.buffers: list[FakeBuffer] = []

    def info(self) -> DeviceInfo:
        return self._info

    def buffer(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> FakeBuffer:
        self.buffers.append(FakeBuffer(shape, dtype))
        return self.buffers[-1]

    def event(self) -> FakeEvent:
        return FakeEvent()

    def synchronize(self) -> None:
        pass


def substitute(
    setitem: Callable[[Any, str, Any], None],
    setattr_: Callable[[Any, str, Any], None],
    tensorrt_version: str = "10.0.1",
    gpu_name: str = GPU_NAME,
    cuda: bool = True,
) -> None:
    """Install the substitutes through `setitem`/`setattr_` (pytest's monkeypatch undoes them after a test)."""
    setitem(sys.modules, "tensorrt", fake_tensorrt)
    setattr_(fake_tensorrt, "__version__", tensorrt_version)
    if cuda:
        setattr_(engines.backends.cuda, "open_device", lambda: FakeDevice(gpu_name))
    engines.backends.tensorrt.trt_logger.cache_clear()  # a logger of the real module must not reach the fake


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fakes.gpu", allow_abbrev=False)
    parser.add_argument("--tensorrt-version", default="10.0.1")
    parser.add_argument("--gpu-name", default=GPU_NAME)
    parser.add_argument("--without-cuda", action="store_true", help="substitute tensorrt only: no CUDA device")
    parser.add_argument("anytime", nargs=argparse.REMAINDER, help="-- then the anytime command line")
    args = parser.parse_args(argv)
    rest = args.anytime[1:] if args.anytime[:1] == ["--"] else args.anytime
    substitute(
        lambda d, k, v: d.__setitem__(k, v), setattr, args.tensorrt_version, args.gpu_name, not args.without_cuda
    )
    from cli.main import main as anytime

    return anytime(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
