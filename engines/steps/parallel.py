"""Cached steps that may run side by side (export, calibration): in this process, or in a small process pool.

Measured on our 2-vCPU machines, the pool did not pay: 12 exports took 33 s in two spawned workers against
about 18 s in one process (each worker imports torch and onnxscript first, and ONNX Runtime's calibration
sessions in two workers fight over the two cores), so one worker is the default. It is never used while
anything is timed.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from engines.steps.context import BuildContext

J = TypeVar("J")


def _init_worker() -> None:
    # One intra-op thread per worker, and denormals flushed as in the parent (calibration runs FP32 stages).
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def run_steps(
    ctx: BuildContext,
    fn: Callable[[J], None],
    steps: Sequence[tuple[str, Any, J]],
    files: Callable[[J], list[Path]],
    desc: str,
) -> None:
    """fn(job) for every (step name, cache key, job) whose step is not fresh; `files(job)` are what it writes."""
    todo = []
    for step, key, job in steps:
        if ctx.cache.lookup(step, key)[0]:
            ctx.cache.skipped.append(step)
        else:
            todo.append((step, key, job))
    if ctx.workers <= 1 or len(todo) <= 1:
        for step, key, job in ctx.bar(todo, desc):
            ctx.cache.run(step, key, functools.partial(fn, job), files(job))
        return
    bar = tqdm(total=len(todo), desc=desc, disable=not ctx.progress, leave=False)
    # spawn, not fork: the parent holds torch and ONNX Runtime thread pools that a fork would copy mid-state.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(ctx.workers, len(todo)), mp_context=context, initializer=_init_worker) as pool:
        futures = {pool.submit(fn, job): (step, key, job) for step, key, job in todo}
        for future in as_completed(futures):
            future.result()  # a failed job fails the build with its own exception
            step, key, job = futures[future]
            ctx.cache.record(step, key, None, files(job))
            ctx.cache.ran.append(step)
            bar.update()
    bar.close()
