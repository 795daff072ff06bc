"""Accuracy of an engine on the val and test splits, from its logits, which are cached by the engine file's sha256.

Evaluation is the build's biggest compute after timing (15,000 images per engine), and none of it is
timed, so it runs with all cores (`eval_threads`) and large batches; latency is measured separately with
the ladder's threads. The logits are kept (`cache/logits/*.npy`): ensembles and cascades reuse them, and an
unchanged engine file is never evaluated twice.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engines.base import Backend, Engine, Precision
from engines.factory import open_engine
from engines.steps.cache import digest
from engines.steps.context import BuildContext
from models.data import PreprocessSpec, Split

EVAL_BATCH = 500
# An engine whose logits are known by another route (an exit's, from the stage chain) must give them on this
# many val images before they stand for its own.
SPOT_CHECK = 256
LOGITS_DIR = Path("cache") / "logits"
SPLITS = ("val", "test")


def predict_logits(
    engine: Engine,
    split: Split,
    spec: PreprocessSpec,
    batch_size: int = 250,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Logits for every image of a split (in order)."""
    outs = []
    for images, _ in split.batches(min(batch_size, engine.max_batch or batch_size)):
        x = spec.normalize(images)
        outs.append(engine.infer(transform(x) if transform else x))
    return np.concatenate(outs)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(1) == labels).mean())


def _tag(ctx: BuildContext, path: Path, backend: Backend, precision: Precision) -> str:
    """Logits are keyed by content: two names for one file (a calibration trial and the rung) share them."""
    return f"{ctx.cache.sha256(path)[:20]}.{backend}.{precision}"


def engine_logits(
    ctx: BuildContext,
    path: Path,
    backend: Backend,
    precision: Precision,
    splits: tuple[str, ...],
    threads: int | None = None,
    same_as: Callable[[str], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Logits of one engine file on each split; computed once per (file sha256, backend, precision, split).

    `same_as(split)`: the same logits by another route, e.g. an FP32 exit's from the stage chain (the same layers
    and weights, cut into stage files): taken for the engine's own once the engine gives them on the first
    SPOT_CHECK val images (to 1e-4), which spares a whole pass over val and test; else the engine is run on all.
    """
    tag = _tag(ctx, path, backend, precision)
    result: dict[str, np.ndarray] = {}
    engine: Engine | None = None
    route = same_as  # set to None once the engine disagrees with it

    def own(split: Split) -> np.ndarray:
        nonlocal engine
        engine = engine or open_engine(backend, path, precision, threads or ctx.eval_threads)
        return predict_logits(engine, split, ctx.inputs.spec, EVAL_BATCH)

    checked = False
    for split_name in splits:
        split = ctx.inputs.split(split_name)
        out = ctx.out / LOGITS_DIR / f"{tag}.{split_name}.npy"
        key = {"file": ctx.cache.sha256(path), "backend": str(backend), "precision": str(precision)}

        def make(out: Path = out, split: Split = split) -> None:
            nonlocal route, checked
            if route is not None and not checked:
                head = own(ctx.inputs.split("val").head(SPOT_CHECK))
                route = route if np.allclose(head, route("val")[:SPOT_CHECK], rtol=1e-4, atol=1e-4) else None
                checked = True
            out.parent.mkdir(parents=True, exist_ok=True)
            np.save(out, route(split.name) if route is not None else own(split))

        ctx.cache.run(f"logits/{tag}/{split_name}", {**key, "split": split.fingerprint}, make, [out])
        result[split_name] = np.load(out)
    if engine is not None:
        engine.close()
    return result


def chain_logits(
    ctx: BuildContext,
    stages: list[tuple[Path, Backend, Precision]],
    split_name: str,
    threads: int | None = None,
) -> list[np.ndarray]:
    """Every exit's logits on a split, running the stage engines as the cascade does (features passed on)."""
    split = ctx.inputs.split(split_name)
    tags = [_tag(ctx, *stage) for stage in stages]
    name = digest(tags)[:20]
    out = ctx.out / LOGITS_DIR / f"chain.{name}.{split_name}.npz"

    def make() -> None:
        engines = [open_engine(b, p, pr, threads or ctx.eval_threads) for p, b, pr in stages]
        per_exit: list[list[np.ndarray]] = [[] for _ in engines]
        batch = min([EVAL_BATCH, *(e.max_batch for e in engines if e.max_batch)])  # a plan's profile caps it
        for images, _ in split.batches(batch):
            x = ctx.inputs.spec.normalize(images)
            for k, engine in enumerate(engines):
                x, logits = engine.run(x)
                per_exit[k].append(logits)
        for e in engines:
            e.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, *[np.concatenate(chunks) for chunks in per_exit])

    ctx.cache.run(f"logits/chain.{name}/{split_name}", {"stages": tags, "split": split.fingerprint}, make, [out])
    with np.load(out) as data:
        return [data[f"arr_{k}"] for k in range(len(stages))]


def exit_logits_via_chain(ctx: BuildContext, stages: list[tuple[Path, Backend, Precision]], exits: list[Path]) -> None:
    """Exit k's logits from the stage chain's k-th output (`chain_logits`, computed first), each spot-checked
    against the exit's own engine (`engine_logits`' `same_as`). The exit files repeat the stages' layers:
    evaluating them too cost 3 more passes over the ResNet."""
    for k, path in enumerate(exits):

        def same_as(split: str, k: int = k) -> np.ndarray:
            return chain_logits(ctx, stages, split, 1)[k]

        _, backend, precision = stages[k]
        engine_logits(ctx, path, backend, precision, SPLITS, 1, same_as)


class Background:
    """Evaluations that run beside export and calibration (nothing is timed then), one ONNX Runtime thread each.

    Export and quantization are mostly Python on one core; evaluation is ONNX Runtime with the GIL released,
    so the two share a 2-core machine well. `wait()` before anything is timed: the calling thread then takes
    queued evaluations too, instead of idling while `workers` threads finish them (the FP32 passes kept one
    core idle for 15 s of a 110 s build).
    """

    def __init__(self, ctx: BuildContext, workers: int = 1) -> None:
        for name in ("val", "test"):
            ctx.inputs.split(name)  # loaded once here, not raced for by the workers
        self.ctx = ctx
        self._queue: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._errors: list[Exception] = []
        self._threads = [
            threading.Thread(target=self._work, args=(True,), name=f"anytime-eval-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, block: bool) -> None:
        """Run queued tasks; a worker (`block`) until it takes the end marker, the waiting thread until none is left."""
        while True:
            try:
                task = self._queue.get(block=block)
            except queue.Empty:
                return
            if task is None:
                return
            try:
                task()
            except Exception as e:  # re-raised by wait() in the build's thread (Ctrl-C there stops it at once)
                self._errors.append(e)

    def _submit(self, fn: Callable[..., object], *args: object) -> None:
        self._queue.put(functools.partial(fn, *args))

    def logits(self, path: Path, backend: Backend, precision: Precision) -> None:
        for split in SPLITS:  # a task per split: the waiting thread can share the last engine's passes
            self._submit(engine_logits, self.ctx, path, backend, precision, (split,), 1)

    def chain(self, stages: list[tuple[Path, Backend, Precision]]) -> None:
        for split in SPLITS:
            self._submit(chain_logits, self.ctx, stages, split, 1)

    def wait(self) -> None:
        """Take queued tasks in this thread too, then wait for the workers; raise the first task's error."""
        self._work(block=False)
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]
