"""torchvision's DenseNet (BC: bottleneck + compression) adapted to small grey images.

A single-exit family (`SingleExit`): every layer sees the concatenated features of all earlier layers of
its block, a connectivity unlike the ResNet's sums, VGG's plain stack and MobileNetV2's depthwise blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from models.registry import SingleExit, register_model


@dataclass(frozen=True)
class DenseNetConfig:
    in_channels: int = 1
    num_classes: int = 10
    growth_rate: int = 24
    block_config: tuple[int, ...] = (4, 6, 6)  # layers per dense block; a transition halves the size between
    num_init_features: int = 32
    bn_size: int = 4  # bottleneck width: bn_size * growth_rate channels before each 3x3 convolution

    def __post_init__(self) -> None:
        if not self.block_config or min(self.block_config) < 1:
            raise ValueError("block_config needs at least one block of at least one layer")
        if min(self.growth_rate, self.num_init_features, self.bn_size) < 1:
            raise ValueError("growth_rate, num_init_features and bn_size must be positive")

    def to_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


class DenseNet(SingleExit):
    def __init__(self, config: DenseNetConfig) -> None:
        super().__init__()
        from torchvision.models import densenet

        self.config = config
        net = densenet.DenseNet(
            growth_rate=config.growth_rate,
            block_config=config.block_config,  # type: ignore[arg-type]
            num_init_features=config.num_init_features,
            bn_size=config.bn_size,
            num_classes=config.num_classes,
        )
        # ImageNet's 7x7 stride-2 stem and 3x3 stride-2 pooling would leave 7x7 of a 28x28 image; a 3x3 stride-1
        # stem keeps the pooling's single halving (28 -> 14), and each transition halves again.
        net.features.conv0 = nn.Conv2d(config.in_channels, config.num_init_features, 3, 1, 1, bias=False)
        nn.init.kaiming_normal_(net.features.conv0.weight)
        self.features, self.classifier = net.features, net.classifier

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.relu(self.features(x))
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        return self.classifier(torch.flatten(x, 1))


def _config(**config: object) -> DenseNetConfig:
    if "block_config" in config:
        config["block_config"] = tuple(config["block_config"])  # type: ignore[call-overload]
    return DenseNetConfig(**config)  # type: ignore[arg-type]


@register_model("densenet")
def densenet(**config: object) -> DenseNet:
    return DenseNet(_config(**config))


@register_model("densenet.fmnist")
def densenet_fmnist(**config: object) -> DenseNet:
    """The default Fashion-MNIST member: growth 24, blocks of 4/6/6 layers at 14x14, 7x7 and 3x3."""
    return DenseNet(_config(**config))
