"""Greedy residual-cut search on val: drop the identity block that costs the least accuracy per ms saved."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from models.data import PreprocessSpec, Split
from models.evaluate import time_call


def _block(model: Any, name: str) -> nn.Module:
    stage, block = name.removeprefix("stage").split(".block")
    return model.stages[int(stage) - 1][int(block) - 1]


@torch.inference_mode()
def block_ms(model: Any, spec: PreprocessSpec, images: np.ndarray, runs: int = 30) -> dict[str, float]:
    """Median torch eager time (ms per image, batch of len(images)) of each cuttable block on its real input."""
    x = torch.from_numpy(spec.normalize(images))
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        _block(model, name).register_forward_pre_hook(lambda _m, args, name=name: inputs.__setitem__(name, args[0]))
        for name in model.cuttable_blocks()
    ]
    model(x)
    for h in hooks:
        h.remove()
    return {
        name: time_call(_block(model, name), feats, runs, warmup=5)["p50"] / len(images)
        for name, feats in inputs.items()
    }


@torch.inference_mode()
def val_accuracy(model: Any, split: Split, spec: PreprocessSpec, cut: tuple[str, ...]) -> float:
    hits = 0
    for images, labels in split.batches(500):
        hits += int((model(torch.from_numpy(spec.normalize(images)), cut=cut).argmax(1).numpy() == labels).sum())
    return hits / len(split)


def greedy_cuts(model: Any, val: Split, spec: PreprocessSpec) -> list[dict[str, float | str]]:
    """The greedy path: at each step the block whose removal costs the least val accuracy per ms saved.

    ms saved per block is measured in torch eager at batch 32 (the exported variants are then measured
    for real with the engines); accuracy is the last exit's on `val`.
    """
    saved = block_ms(model, spec, val.images[:32])
    cut: tuple[str, ...] = ()
    current = val_accuracy(model, val, spec, cut)
    steps: list[dict[str, float | str]] = []
    remaining = list(saved)
    while remaining:
        scored = []
        for name in remaining:
            acc = val_accuracy(model, val, spec, (*cut, name))
            scored.append(((current - acc) / max(saved[name], 1e-9), name, acc))
        _, name, acc = min(scored)
        cut = (*cut, name)
        remaining.remove(name)
        steps.append({"dropped": name, "val_accuracy": acc, "ms_saved_per_image": saved[name]})
        current = acc
    return steps
