"""The CUDA side of the TensorRT backend (engines/backends/cuda.py) on a real GPU, without TensorRT: the device's
description, pinned host <-> device copies on the engine's stream, and event timing. Skipped without a CUDA GPU;
tests/fakes/gpu.py stands in for this module on a CPU."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from engines.backends.cuda import Device, open_device
from tests.engines.gpu import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]

ITEM = (1, 28, 28)


@pytest.fixture(scope="module")
def device() -> Device:
    return open_device()


def test_the_device_is_described_as_torch_sees_it(device: Device) -> None:
    import torch

    info = device.info()
    assert info.gpu_name == torch.cuda.get_device_name()
    assert re.fullmatch(r"\d+\.\d+", info.compute_capability)
    assert info.compute_capability == "{}.{}".format(*torch.cuda.get_device_capability())
    assert info.cuda_version == torch.version.cuda
    assert device.stream_handle != 0  # a stream of our own, not the legacy default stream


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float16])
def test_a_batch_goes_to_the_gpu_and_back_unchanged(device: Device, dtype: type) -> None:
    rng = np.random.default_rng(7)
    buffer = device.buffer((8, *ITEM), np.dtype(dtype))
    for n in (8, 3, 1):  # a full batch, then smaller ones in the first rows of the same memory
        x = (rng.random((n, *ITEM)) * 200).astype(dtype)
        buffer.upload(x)
        buffer.download(x.shape)
        device.synchronize()
        np.testing.assert_array_equal(buffer.host(x.shape), x)


def test_the_source_array_may_be_reused_as_soon_as_upload_returns(device: Device) -> None:
    x = np.arange(4 * math.prod(ITEM), dtype=np.float32).reshape(4, *ITEM)
    sent = x.copy()
    buffer = device.buffer(x.shape, np.dtype(np.float32))
    buffer.upload(x)
    x[:] = -1.0  # the caller's array changes before the copy has necessarily run
    buffer.download(x.shape)
    device.synchronize()
    np.testing.assert_array_equal(buffer.host(x.shape), sent)


def test_the_host_copy_is_the_callers_own(device: Device) -> None:
    buffer = device.buffer((2, *ITEM), np.dtype(np.float32))
    buffer.upload(np.ones((2, *ITEM), np.float32))
    buffer.download((2, *ITEM))
    device.synchronize()
    first = buffer.host((2, *ITEM))
    buffer.upload(np.zeros((2, *ITEM), np.float32))
    buffer.download((2, *ITEM))
    device.synchronize()
    assert first.min() == 1.0  # not a view of the pinned memory the next download overwrote


def test_events_time_the_work_queued_between_them(device: Device) -> None:
    big = device.buffer((64, 1024, 1024), np.dtype(np.float32))  # 256 MiB each way
    x = np.ones((64, 1024, 1024), np.float32)
    start = device.event()
    big.upload(x)
    big.download(x.shape)
    end = device.event()
    device.synchronize()
    copied = start.elapsed_ms(end)
    empty_start = device.event()
    empty_end = device.event()
    device.synchronize()
    nothing = empty_start.elapsed_ms(empty_end)
    assert math.isfinite(copied) and copied > 0
    assert 0 <= nothing < copied  # two events with nothing between them time (almost) nothing
    # 512 MiB over PCIe or NVLink-C2C: slower than 1 TB/s and faster than 0.5 GB/s on any GPU we serve from
    assert 0.5 < copied < 1000


def test_the_cuda_benchmark_prints_a_line_per_round(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cuda import main

    main(["--runs", "100", "--rounds", "2"])
    out = capsys.readouterr().out
    assert out.count("upload + download + synchronize  p50") == 2 and "synchronize of an empty stream" in out
