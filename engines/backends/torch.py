"""The torch reference engine: runs the checkpoint's own modules, to verify the others."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engines.base import Backend, EngineBase, Precision


class TorchEngine(EngineBase):
    backend = Backend.TORCH
    precision = Precision.FP32

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
        input_shape: tuple[int, ...],
        output_names: list[str],
    ) -> None:
        self.fn, self.input_shape, self.output_names = fn, tuple(input_shape), output_names
        self.input_name = "input"

    @torch.inference_mode()
    def run(self, x: np.ndarray) -> list[np.ndarray]:
        out = self.fn(torch.from_numpy(np.ascontiguousarray(x, np.float32)))
        outs = out if isinstance(out, tuple) else (out,)
        return [o.numpy() for o in outs]
