"""The one calibration data interface: batches of model input built from (split, preprocessing, transform)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from models.data import PreprocessSpec, Split

Transform = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class CalibrationSet:
    """The first `samples` images of a split, normalized, then passed through `transform`.

    For a cascade stage k > 1 the transform is the FP32 run of stages 1..k-1, so each stage is
    calibrated on the features it really receives.
    """

    split: Split
    spec: PreprocessSpec
    samples: int = 1000
    batch_size: int = 50
    transform: Transform | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= len(self.split):
            raise ValueError(f"calibration wants {self.samples} samples; split {self.split.name} has {len(self.split)}")

    def batches(self) -> Iterator[np.ndarray]:
        images = self.split.images[: self.samples]
        for i in range(0, len(images), self.batch_size):
            x = self.spec.normalize(images[i : i + self.batch_size])
            yield self.transform(x) if self.transform is not None else x

    def record(self) -> dict[str, object]:
        """What the manifest says about the data a calibration used."""
        return {
            "split": self.split.name,
            "fingerprint": self.split.head(self.samples).fingerprint,
            "samples": self.samples,
        }


class OrtCalibrationReader(CalibrationDataReader):
    """ONNX Runtime's reader over a CalibrationSet; rewindable."""

    def __init__(self, calib: CalibrationSet, input_name: str) -> None:
        self.calib, self.input_name = calib, input_name
        self._it: Iterator[np.ndarray] | None = None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = self.calib.batches()
        batch = next(self._it, None)
        return None if batch is None else {self.input_name: batch}

    def rewind(self) -> None:
        self._it = None
