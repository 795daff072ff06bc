"""How raw pixels become model input. Its own module: the server needs it without the dataset code (torchvision)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class PreprocessSpec:
    """How raw pixels become model input: shape (C, H, W), dtype, per-channel mean/std on [0, 1] pixels."""

    input_shape: tuple[int, int, int]
    dtype: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def normalize(self, images: np.ndarray) -> np.ndarray:
        """uint8 images (N, H, W) or (N, C, H, W) -> normalized float32 (N, C, H, W)."""
        if images.dtype == np.uint8 and images.ndim == 3 and len(self.mean) == 1:
            return self._table[images][:, None]  # one lookup instead of five array passes (the server's hot path)
        x = images.astype(np.float32) / 255.0
        if x.ndim == 3:
            x = x[:, None]
        mean = np.asarray(self.mean, np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(1, -1, 1, 1)
        return ((x - mean) / std).astype(self.dtype)

    @cached_property
    def _table(self) -> np.ndarray:
        """What `normalize` makes of each grey value 0..255, computed by the same float32 arithmetic."""
        x = np.arange(256, dtype=np.uint8).astype(np.float32) / 255.0
        return ((x - np.float32(self.mean[0])) / np.float32(self.std[0])).astype(self.dtype)

    def to_dict(self) -> dict[str, object]:
        return {
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "mean": list(self.mean),
            "std": list(self.std),
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> PreprocessSpec:
        shape: tuple[int, int, int] = tuple(d["input_shape"])  # type: ignore[arg-type, assignment]
        spec = cls(shape, str(d["dtype"]), tuple(d["mean"]), tuple(d["std"]))  # type: ignore[arg-type]
        if len(spec.input_shape) != 3 or len(spec.mean) != spec.input_shape[0] or len(spec.std) != len(spec.mean):
            raise ValueError(f"inconsistent preprocessing spec {d}")
        return spec
