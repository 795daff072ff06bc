"""torchvision's MobileNetV2 adapted to small grey images: one input channel, a shallower stride plan.

A single-exit family (`SingleExit`): the ensemble's depthwise member, different in kind from the ResNet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor, nn

from models.registry import SingleExit, register_model

# (expansion t, channels c, repeats n, first stride s) as in torchvision; three stride-2 steps in all
# (stem included) take 28x28 to 4x4 instead of ImageNet's 32x reduction.
FMNIST_SETTING = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 3, 2), (6, 96, 2, 1))


@dataclass(frozen=True)
class MobileNetV2Config:
    in_channels: int = 1
    num_classes: int = 10
    setting: tuple[tuple[int, int, int, int], ...] = FMNIST_SETTING
    width_mult: float = 1.0
    stem_stride: int = 2
    last_channel: int = 512
    dropout: float = 0.2

    def __post_init__(self) -> None:
        if not self.setting or any(len(row) != 4 or min(row) < 1 for row in self.setting):
            raise ValueError("setting needs rows of four positive integers (t, c, n, s)")
        if self.width_mult <= 0 or self.stem_stride < 1 or self.last_channel < 1:
            raise ValueError("width_mult, stem_stride and last_channel must be positive")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["setting"] = [list(row) for row in self.setting]
        return d


class MobileNetV2(SingleExit):
    def __init__(self, config: MobileNetV2Config) -> None:
        super().__init__()
        from torchvision.models import mobilenetv2

        self.config = config
        net = mobilenetv2.MobileNetV2(
            num_classes=config.num_classes,
            width_mult=config.width_mult,
            inverted_residual_setting=[list(row) for row in config.setting],
            dropout=config.dropout,
        )
        net.last_channel = config.last_channel
        stem = net.features[0]
        stem[0] = nn.Conv2d(config.in_channels, stem[0].out_channels, 3, config.stem_stride, 1, bias=False)
        nn.init.kaiming_normal_(stem[0].weight, mode="fan_out")
        head = net.features[-1]
        head[0] = nn.Conv2d(head[0].in_channels, config.last_channel, 1, bias=False)
        head[1] = nn.BatchNorm2d(config.last_channel)
        nn.init.kaiming_normal_(head[0].weight, mode="fan_out")
        net.classifier[1] = nn.Linear(config.last_channel, config.num_classes)
        nn.init.normal_(net.classifier[1].weight, 0, 0.01)
        nn.init.zeros_(net.classifier[1].bias)
        self.features, self.classifier = net.features, net.classifier

    def forward(self, x: Tensor) -> Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(x.flatten(1))


def _config(**config: object) -> MobileNetV2Config:
    if "setting" in config:
        config["setting"] = tuple(tuple(row) for row in config["setting"])  # type: ignore[attr-defined]
    return MobileNetV2Config(**config)  # type: ignore[arg-type]


@register_model("mobilenetv2")
def mobilenetv2(**config: object) -> MobileNetV2:
    return MobileNetV2(_config(**config))


@register_model("mobilenetv2.fmnist")
def mobilenetv2_fmnist(**config: object) -> MobileNetV2:
    """The default Fashion-MNIST member: stride-2 stem, 16..96 channels, 512-wide head."""
    return MobileNetV2(_config(**config))
