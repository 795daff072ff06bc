"""The torch module behind each exported graph: a cascade stage (features in, features and logits out), a
fixed exit with some residual blocks cut, or a member's mirror view."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StageGraph(nn.Module):
    """stage_k: features_{k-1} (the image for k = 1) -> (features_k, logits_k)."""

    def __init__(self, model: Any, k: int) -> None:  # any multi-exit network (forward_stage/forward_exit)
        super().__init__()
        self.model, self.k = model, k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.model.forward_stage(self.k, x)
        return features, self.model.forward_exit(self.k, features)


class ExitGraph(nn.Module):
    """input -> logits of exit k, with the blocks in `cut` dropped."""

    def __init__(self, model: Any, k: int, cut: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model, self.k, self.cut = model, k, cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, exit=self.k, cut=self.cut)


class MirrorGraph(nn.Module):
    """A member's mirror view: the member run on the image flipped left to right (test-time augmentation).

    A model trained on randomly flipped images (`anytime train` flips half of each batch) answers the mirrored
    image about as well, but makes partly different mistakes, so the view is a nearly free ensemble member."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(torch.flip(x, dims=(-1,)))


def stage_input_shape(model: Any, input_shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """Shape of one item entering stage k."""
    x = torch.zeros(1, *input_shape)
    with torch.inference_mode():
        for s in range(1, k):
            x = model.forward_stage(s, x)
    return tuple(x.shape[1:])
