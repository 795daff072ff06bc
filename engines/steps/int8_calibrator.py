"""INT8 plans on TensorRT 8.x (JetPack 6.0): an entropy calibrator fed by our calibration data, with a cache.

TensorRT >= 10 builds INT8 plans from the symmetric QDQ ONNX file instead (DESIGN.md decision 2: its
implicit calibrators are deprecated since 10.1). The batches are the same `CalibrationSet` that ONNX
Runtime's quantization reads (calibration/data.py), so both backends calibrate on the same images.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from calibration.data import CalibrationSet
from engines.backends.cuda import Device


@dataclass(frozen=True)
class Int8Calibration:
    data: CalibrationSet
    cache: Path  # TensorRT's calibration cache: read when it exists (no calibration runs), written otherwise


def full_batches(data: CalibrationSet) -> Iterator[np.ndarray]:
    """The calibration batches, all of `data.batch_size` images: the calibration profile has one fixed shape."""
    for x in data.batches():
        if len(x) == data.batch_size:
            yield np.ascontiguousarray(x, dtype=np.float32)


def entropy_calibrator(
    trt: ModuleType, calibration: Int8Calibration, device: Device, item_shape: tuple[int, ...]
) -> Any:
    """A `trt.IInt8EntropyCalibrator2` over the calibration batches (defined here: its base class is TensorRT's)."""
    batch = calibration.data.batch_size

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._batches = full_batches(calibration.data)
            self._buffer = device.buffer((batch, *item_shape), np.dtype(np.float32))
            self.batches_fed = 0

        def get_batch_size(self) -> int:
            return batch

        def get_batch(self, names: list[str], *_: Any) -> list[int] | None:
            x = next(self._batches, None)
            if x is None:
                return None  # the end of the data
            self._buffer.upload(x)
            device.synchronize()  # TensorRT reads the buffer on its own stream
            self.batches_fed += 1
            return [self._buffer.ptr]  # the one input (build_plan checks there is one)

        def read_calibration_cache(self) -> bytes | None:
            return calibration.cache.read_bytes() if calibration.cache.is_file() else None

        def write_calibration_cache(self, cache: Any) -> None:
            calibration.cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = calibration.cache.with_name(calibration.cache.name + ".partial")
            tmp.write_bytes(bytes(cache))
            os.replace(tmp, calibration.cache)

    return EntropyCalibrator()
