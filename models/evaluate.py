"""Per-exit accuracy, size, MACs and latency of a checkpoint (`anytime evaluate`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.checkpoint import Checkpoint
from models.data import DataSource
from models.train import evaluate_exits, set_determinism


def count_macs(fn: Any, *args: Any) -> int:
    """Multiply-accumulates of one call, from torch's flop counter (which counts 2 flops per MAC)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops() // 2


def exit_params(model: Any, k: int) -> int:
    """Parameters that exit k's answer uses: the stem, stages 1..k and exit head k (all, for one exit)."""
    modules = [model] if model.num_stages == 1 else [model.stem, *model.stages[:k], model.exits[k - 1]]
    return sum(p.numel() for m in modules for p in m.parameters())


def exit_fn(model: Any, k: int) -> Any:
    """The forward pass that answers at exit k (single-exit families have only their plain forward)."""
    return model if model.num_stages == 1 else lambda x: model(x, exit=k)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1e3
    return {f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}


def time_call(fn: Any, x: torch.Tensor, runs: int, warmup: int = 20) -> dict[str, float]:
    """Latency percentiles (ms) of fn(x) over `runs` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn(x)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


@torch.inference_mode()
def evaluate_checkpoint(
    ckpt: Checkpoint, source: DataSource, threads: int = 2, runs: int = 200, limit: int | None = None
) -> dict[str, Any]:
    """Test accuracy per exit (recomputed; on the first `limit` test images if given), params, MACs, and torch
    eager latency at batch 1 and 32."""
    set_determinism(0, threads)
    model = ckpt.build_model()
    spec = ckpt.preprocess
    test = source.split("test")
    test = test.head(limit) if limit is not None else test
    accuracy = evaluate_exits(model, test, spec, progress=True)
    rows = []
    for k in range(1, model.num_stages + 1):
        row: dict[str, Any] = {
            "exit": k,
            "test_accuracy": accuracy[k - 1],
            "params": exit_params(model, k),
            "macs": count_macs(exit_fn(model, k), torch.zeros(1, *spec.input_shape)),
        }
        for batch in (1, 32):
            x = torch.randn(batch, *spec.input_shape)
            row[f"torch_ms_b{batch}"] = time_call(exit_fn(model, k), x, runs)
        rows.append(row)
    lines = [
        f"checkpoint {ckpt.model_name} trained by: {ckpt.command}",
        f"test split {test.fingerprint[:12]} ({len(test)} images); torch {torch.__version__} eager, "
        f"{threads} threads, {runs} timed runs after 20 warm-up, ms p50/p90/p99",
        f"{'exit':>4} {'test acc':>9} {'params':>9} {'MACs':>11} {'batch 1 ms':>20} {'batch 32 ms':>22}",
    ]
    for r in rows:
        b1, b32 = r["torch_ms_b1"], r["torch_ms_b32"]
        lines.append(
            f"{r['exit']:>4} {r['test_accuracy']:>9.2%} {r['params']:>9,} {r['macs']:>11,} "
            f"{b1['p50']:>6.2f}/{b1['p90']:.2f}/{b1['p99']:.2f} {b32['p50']:>7.2f}/{b32['p90']:.2f}/{b32['p99']:.2f}"
        )
    return {
        "checkpoint": ckpt.model_name,
        "test_fingerprint": test.fingerprint,
        "threads": threads,
        "runs": runs,
        "exits": rows,
        "text": "\n".join(lines),
    }
