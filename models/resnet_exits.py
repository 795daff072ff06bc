"""CIFAR-style ResNet with an exit head after every stage, and residual cuts as configuration.

Stage 1 includes the stem. Stages and exits are numbered from 1. A block is named
`stage{s}.block{b}` (both from 1); only blocks whose shortcut is the identity can be cut.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from models.registry import register_model


@dataclass(frozen=True)
class ResNetExitsConfig:
    in_channels: int = 1
    num_classes: int = 10
    widths: tuple[int, ...] = (32, 64, 128)
    blocks: tuple[int, ...] = (2, 2, 2)
    stem_stride: int = 1
    exit_pool: int = 1  # exit heads average-pool to an exit_pool x exit_pool grid; 1 is the global pool

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.blocks) or not self.widths:
            raise ValueError("widths and blocks need one entry per stage")
        if min(self.widths) < 1 or min(self.blocks) < 1 or self.stem_stride < 1 or self.exit_pool < 1:
            raise ValueError("every stage needs a positive width and at least one block")

    def to_dict(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.identity = stride == 1 and in_ch == out_ch
        self.shortcut: nn.Module = (
            nn.Identity()
            if self.identity
            else nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ExitHead(nn.Module):
    """Average pool to a grid x grid map (1: global pool), then linear."""

    def __init__(self, channels: int, num_classes: int, grid: int = 1) -> None:
        super().__init__()
        self.grid = grid
        self.fc = nn.Linear(channels * grid * grid, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, self.grid), 1))


class ResNetExits(nn.Module):
    def __init__(self, config: ResNetExitsConfig) -> None:
        super().__init__()
        self.config = config
        first = config.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, first, 3, config.stem_stride, 1, bias=False),
            nn.BatchNorm2d(first),
            nn.ReLU(inplace=True),
        )
        self.stages: list[nn.ModuleList] = nn.ModuleList()  # type: ignore[assignment]
        in_ch = first
        for s, (width, count) in enumerate(zip(config.widths, config.blocks, strict=True)):
            stride = 1 if s == 0 else 2
            blocks = [BasicBlock(in_ch if b == 0 else width, width, stride if b == 0 else 1) for b in range(count)]
            self.stages.append(nn.ModuleList(blocks))
            in_ch = width
        self.exits = nn.ModuleList(ExitHead(w, config.num_classes, config.exit_pool) for w in config.widths)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init the last BN of each block so every residual branch starts as the identity:
        # trains faster, and makes dropping a block at inference less harmful.
        for m in self.modules():
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def block_names(self) -> list[str]:
        return [f"stage{s + 1}.block{b + 1}" for s, st in enumerate(self.stages) for b in range(len(st))]

    def cuttable_blocks(self) -> list[str]:
        """Names of the blocks whose shortcut is the identity: the only ones a residual cut may drop."""
        return [
            f"stage{s + 1}.block{b + 1}"
            for s, st in enumerate(self.stages)
            for b, blk in enumerate(st)
            if isinstance(blk, BasicBlock) and blk.identity
        ]

    def check_cut(self, cut: Iterable[str]) -> frozenset[str]:
        """Validate a residual cut; raise ValueError naming the allowed blocks."""
        cut = frozenset(cut)
        allowed = self.cuttable_blocks()
        bad = sorted(cut - set(allowed))
        if bad:
            raise ValueError(
                f"cannot cut {', '.join(bad)}: only blocks with an identity shortcut can be cut ({', '.join(allowed)})"
            )
        return cut

    def _check_stage(self, k: int) -> None:
        if not 1 <= k <= self.num_stages:
            raise ValueError(f"stage/exit {k} out of range 1..{self.num_stages}")

    def forward_stage(self, k: int, x: Tensor, cut: frozenset[str] = frozenset()) -> Tensor:
        """Run stage k (1-based; stage 1 includes the stem) on the previous stage's features."""
        self._check_stage(k)
        if k == 1:
            x = self.stem(x)
        for b, block in enumerate(self.stages[k - 1]):
            if f"stage{k}.block{b + 1}" not in cut:
                x = block(x)
        return x

    def forward_exit(self, k: int, features: Tensor) -> Tensor:
        """Exit head k on stage k's features."""
        self._check_stage(k)
        return self.exits[k - 1](features)

    def forward(self, x: Tensor, exit: int | None = None, cut: Iterable[str] = ()) -> Tensor:
        """Logits of exit `exit` (default: the last), with the blocks in `cut` dropped."""
        k = self.num_stages if exit is None else exit
        self._check_stage(k)
        dropped = self.check_cut(cut) if cut else frozenset()
        for s in range(1, k + 1):
            x = self.forward_stage(s, x, dropped)
        return self.forward_exit(k, x)

    def forward_all(self, x: Tensor) -> list[Tensor]:
        """Logits of every exit in one pass (training and evaluation)."""
        outs = []
        for s in range(1, self.num_stages + 1):
            x = self.forward_stage(s, x)
            outs.append(self.forward_exit(s, x))
        return outs


def _config(**config: object) -> ResNetExitsConfig:
    for key in ("widths", "blocks"):
        if key in config:
            config[key] = tuple(config[key])  # type: ignore[arg-type]
    return ResNetExitsConfig(**config)  # type: ignore[arg-type]


@register_model("resnet_exits")
def resnet_exits(**config: object) -> ResNetExits:
    return ResNetExits(_config(**config))


@register_model("resnet_exits.small")
def resnet_exits_small(**config: object) -> ResNetExits:
    """16/32/64 channels, one block per stage: trains in seconds, for tests."""
    return ResNetExits(_config(**{"widths": (16, 32, 64), "blocks": (1, 1, 1), **config}))


@register_model("resnet_exits.fmnist")
def resnet_exits_fmnist(**config: object) -> ResNetExits:
    """The default Fashion-MNIST net: 48/96/192 channels, 2/2/3 blocks, stride-2 stem, 4x4-pooled exits.

    The stride-2 stem cuts training and inference cost 4x at 28x28 input; pooling exits to a 4x4 grid
    instead of 1x1 measured +17 pp exit-1 val accuracy after one epoch on 20k images (79.7 vs 62.6 %).
    """
    defaults = {"widths": (48, 96, 192), "blocks": (2, 2, 3), "stem_stride": 2, "exit_pool": 4}
    return ResNetExits(_config(**{**defaults, **config}))
