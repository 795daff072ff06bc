"""A small VGG-style net: stacks of 3x3 conv + BN + ReLU, max pooling between stages, an MLP-free head.

A single-exit family (`SingleExit`), plain (no shortcuts) and wide: an ensemble member unlike the ResNet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from models.registry import SingleExit, register_model


@dataclass(frozen=True)
class VGGConfig:
    in_channels: int = 1
    num_classes: int = 10
    widths: tuple[int, ...] = (32, 64, 128)
    blocks: tuple[int, ...] = (2, 2, 2)  # convolutions per stage
    head_pool: int = 2  # the last features are average-pooled to head_pool x head_pool before the linear head
    dropout: float = 0.2

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.blocks) or not self.widths:
            raise ValueError("widths and blocks need one entry per stage")
        if min(self.widths) < 1 or min(self.blocks) < 1 or self.head_pool < 1:
            raise ValueError("every stage needs a positive width and at least one convolution")

    def to_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


class VGG(SingleExit):
    def __init__(self, config: VGGConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        in_ch = config.in_channels
        for s, (width, count) in enumerate(zip(config.widths, config.blocks, strict=True)):
            if s > 0:
                layers.append(nn.MaxPool2d(2))
            for _ in range(count):
                layers += [nn.Conv2d(in_ch, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                in_ch = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Dropout(config.dropout), nn.Linear(in_ch * config.head_pool**2, config.num_classes)
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), self.config.head_pool)
        return self.head(torch.flatten(x, 1))


def _config(**config: object) -> VGGConfig:
    for key in ("widths", "blocks"):
        if key in config:
            config[key] = tuple(config[key])  # type: ignore[arg-type]
    return VGGConfig(**config)  # type: ignore[arg-type]


@register_model("vgg")
def vgg(**config: object) -> VGG:
    return VGG(_config(**config))


@register_model("vgg.fmnist")
def vgg_fmnist(**config: object) -> VGG:
    """The default Fashion-MNIST member: 32/64/128 channels, two convolutions per stage (28, 14, 7 px)."""
    return VGG(_config(**config))
