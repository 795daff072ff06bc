"""Model registry: families register a builder; `create_model("family.variant", **config)` builds one."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

Builder = Callable[..., nn.Module]

_REGISTRY: dict[str, Builder] = {}
FAMILIES = ("models.densenet", "models.mobilenet", "models.resnet_exits", "models.vgg")  # each registers itself


class SingleExit(nn.Module):
    """A family with one answer (an ensemble member): the multi-exit interface over its plain forward."""

    num_stages = 1

    def forward_all(self, x: Tensor) -> list[Tensor]:
        """The one exit's logits, as a list (the training loop's multi-exit interface)."""
        return [self(x)]


class UnknownModel(KeyError):
    """No family or variant is registered under the name."""


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Register a builder under `name` (a family, or `family.variant` with preset options)."""

    def decorate(fn: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return decorate


def _load_families() -> None:
    for module in FAMILIES:
        importlib.import_module(module)


def list_models() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def create_model(name: str, **config: Any) -> nn.Module:
    """Build a registered model; unknown names raise UnknownModel (a KeyError) listing the known ones."""
    _load_families()
    try:
        builder = _REGISTRY[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(list_models())}") from None
    return builder(**config)
