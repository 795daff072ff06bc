"""Accuracy of an engine on the val and test splits, from its logits, which are cached by the engine file's sha256.

Evaluation is the build's biggest compute after timing (15,000 images per engine), and none of it is
timed, so it runs with all cores (`eval_threads`) and large batches; latency is measured separately with
the ladder's threads. The logits are kept (`cache/logits/*.npy`): ensembles and cascades reuse them, and an
unchanged engine file is never evaluated twice.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from engines.base import Backend, Engine, Precision
from engines.factory import open_engine
from engines.steps.context import BuildContext
from models.data import PreprocessSpec, Split

EVAL_BATCH = 500
LOGITS_DIR = Path("cache") / "logits"


def predict_logits(
    engine: Engine,
    split: Split,
    spec: PreprocessSpec,
    batch_size: int = 250,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Logits for every image of a split (in order)."""
    outs = []
    for images, _ in split.batches(batch_size):
        x = spec.normalize(images)
        outs.append(engine.infer(transform(x) if transform else x))
    return np.concatenate(outs)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())


def engine_logits(
    ctx: BuildContext, name: str, path: Path, backend: Backend, precision: Precision, splits: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Logits of one engine file on each split; computed once per (file sha256, backend, precision, split)."""
    sha = ctx.cache.sha256(path)
    result: dict[str, np.ndarray] = {}
    engine: Engine | None = None
    for split_name in splits:
        split = ctx.inputs.split(split_name)
        out = ctx.out / LOGITS_DIR / f"{name}.{split_name}.npy"
        key = {"file": sha, "backend": str(backend), "precision": str(precision), "split": split.fingerprint}

        def make(out: Path = out, split: Split = split) -> None:
            nonlocal engine
            engine = engine or open_engine(backend, path, precision, ctx.eval_threads)
            out.parent.mkdir(parents=True, exist_ok=True)
            np.save(out, predict_logits(engine, split, ctx.inputs.spec, EVAL_BATCH))

        ctx.cache.run(f"logits/{name}/{split_name}", key, make, [out])
        result[split_name] = np.load(out)
    if engine is not None:
        engine.close()
    return result


def chain_logits(
    ctx: BuildContext, name: str, stages: list[tuple[Path, Backend, Precision]], split_name: str
) -> list[np.ndarray]:
    """Every exit's logits on a split, running the stage engines as the cascade does (features passed on)."""
    split = ctx.inputs.split(split_name)
    out = ctx.out / LOGITS_DIR / f"{name}.{split_name}.npz"
    key = {
        "stages": [[ctx.cache.sha256(p), str(b), str(pr)] for p, b, pr in stages],
        "split": split.fingerprint,
    }

    def make() -> None:
        engines = [open_engine(b, p, pr, ctx.eval_threads) for p, b, pr in stages]
        per_exit: list[list[np.ndarray]] = [[] for _ in engines]
        for images, _ in split.batches(EVAL_BATCH):
            x = ctx.inputs.spec.normalize(images)
            for k, engine in enumerate(engines):
                x, logits = engine.run(x)
                per_exit[k].append(logits)
        for e in engines:
            e.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, *[np.concatenate(chunks) for chunks in per_exit])

    ctx.cache.run(f"logits/{name}/{split_name}", key, make, [out])
    with np.load(out) as data:
        return [data[f"arr_{k}"] for k in range(len(stages))]
