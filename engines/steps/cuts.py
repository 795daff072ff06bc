"""Greedy residual-cut search on val: drop the identity block that costs the least accuracy per ms saved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from engines.steps.context import BuildContext
from models.data import PreprocessSpec, Split
from models.evaluate import time_call


@dataclass(frozen=True)
class CutConfig:
    min_cuts: int = 3
    max_drop_pp: float = 5.0  # a cut variant this far below the full network's val accuracy is never kept
    search_images: int = 2000  # val images the greedy search scores each removal on
    # The search stops once its path is this much further below the full network (on its val images) than
    # `max_drop_pp`, and variants there are not exported: they can never be candidates.
    search_margin_pp: float = 2.0


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


@torch.inference_mode()
def removal_accuracies(
    model: Any, split: Split, spec: PreprocessSpec, cut: tuple[str, ...], candidates: list[str]
) -> dict[str, float]:
    """The last exit's accuracy on `split` with each candidate block dropped on top of `cut`, as
    `val_accuracy(model, split, spec, (*cut, candidate))` gives it, in one walk per batch: the blocks before a
    candidate run once, not once per candidate (the default model's search: 18.1 -> 13.5 s)."""
    names = model.block_names()
    hits = dict.fromkeys(candidates, 0)
    for images, labels in split.batches(500):
        x = model.stem(torch.from_numpy(spec.normalize(images)))
        for i, name in enumerate(names):
            if name in hits:
                y = x
                for later in names[i + 1 :]:
                    if later not in cut:
                        y = _block(model, later)(y)
                hits[name] += int((model.forward_exit(model.num_stages, y).argmax(1).numpy() == labels).sum())
            if name not in cut:
                x = _block(model, name)(x)
    return {name: h / len(split) for name, h in hits.items()}


def greedy_cuts(
    model: Any, val: Split, spec: PreprocessSpec, stop_below_pp: float = 100.0
) -> list[dict[str, float | str]]:
    """The greedy path: at each step the block whose removal costs the least val accuracy per ms saved.

    ms saved per block is measured in torch eager at batch 32 (the exported variants are then measured
    for real with the engines); accuracy is the last exit's on `val`. The path ends once it is more than
    `stop_below_pp` below the full network.
    """
    return _greedy_path(model, val, spec, block_ms(model, spec, val.images[:32]), stop_below_pp)[1]


def _greedy_path(
    model: Any, val: Split, spec: PreprocessSpec, saved: dict[str, float], stop_below_pp: float
) -> tuple[float, list[dict[str, float | str]]]:
    cut: tuple[str, ...] = ()
    current = full = val_accuracy(model, val, spec, cut)
    steps: list[dict[str, float | str]] = []
    remaining = list(saved)
    while remaining and current >= full - stop_below_pp / 100:
        accs = removal_accuracies(model, val, spec, cut, remaining)
        scored = [((current - accs[name]) / max(saved[name], 1e-9), name, accs[name]) for name in remaining]
        _, name, acc = min(scored)
        cut = (*cut, name)
        remaining.remove(name)
        steps.append({"dropped": name, "val_accuracy": acc, "ms_saved_per_image": saved[name]})
        current = acc
    return full, steps


def search_cuts(ctx: BuildContext, config: CutConfig) -> tuple[float, list[dict[str, float | str]]]:
    """(the full network's search accuracy, the greedy path); reused while the checkpoint and val are unchanged."""
    val = ctx.inputs.split("val").head(config.search_images)
    key = {
        "checkpoint": ctx.inputs.artifact.sha256,
        "val": val.fingerprint,
        "stop_below_pp": config.max_drop_pp + config.search_margin_pp,
        "threads": ctx.threads,  # block timings rank the removals
        "torch": ctx.versions["torch"],
    }

    def make() -> dict[str, Any]:
        # One torch thread for the timings and the accuracy passes alike: with two, a pass took 2.5x longer
        # whenever another process held the second core (torch's OpenMP threads wait on each other).
        threads = torch.get_num_threads()
        torch.set_num_threads(ctx.threads)
        try:
            full, path = _greedy_path(
                ctx.inputs.model,
                val,
                ctx.inputs.spec,
                block_ms(ctx.inputs.model, ctx.inputs.spec, val.images[:32]),
                config.max_drop_pp + config.search_margin_pp,
            )
        finally:
            torch.set_num_threads(threads)
        return {"full": full, "steps": path}

    result = ctx.cache.run("cut-search", key, make)
    return float(result["full"]), result["steps"]


def exported_cuts(full: float, steps: list[dict[str, float | str]], config: CutConfig) -> list[tuple[str, ...]]:
    """The cumulative cuts of the path that can still be candidates (within max_drop + margin on the search)."""
    floor = full - (config.max_drop_pp + config.search_margin_pp) / 100
    cuts = [tuple(str(s["dropped"]) for s in steps[: i + 1]) for i in range(len(steps))]
    return [c for c, s in zip(cuts, steps, strict=True) if float(s["val_accuracy"]) >= floor]
