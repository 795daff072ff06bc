"""A quick probe: which precisions besides FP32 (INT8 on ONNX Runtime, BF16 on OpenVINO, FP16 on ONNX Runtime)
can pay on this machine.

The rule (`decide`): on one representative graph (the last exit), a precision can pay only if
  1. it is faster than FP32 at batch 1 by at least `min_speedup` (it is no more accurate than FP32, so an
     engine that is not faster is dominated by the FP32 one); INT8 by at least `int8_min_speedup`, and
  2. for BF16 and FP16: the INT8 engine of the same graph, where INT8 pays, does not dominate it: it is
     faster than INT8 at batch 1, or more accurate than INT8 on val by more than `tie_se` standard errors (a
     BF16 rung is useful only between INT8 and FP32 on the front; one val image more, 0.02 pp, is noise: a
     re-export that moved INT8's val accuracy by one image built six BF16 rungs that no plan served).
INT8 fails rule 1 on x86 CPUs without VNNI: ONNX Runtime's u8s8 kernels there (VPMADDUBSW) were slower than
FP32 for every graph of the default ladder (AMD EPYC, AVX2, 2026-11-25: batch-1 p50 INT8 / FP32 1.09 for exit
1, 1.07 for exit 3, 1.13 for VGG, 1.44 for DenseNet), so every INT8 rung there was dominated and its
calibration, evaluation and profiles were most of the build's time; on a CPU with AVX-512 VNNI INT8 ran at
0.46-0.58x FP32 at batch 1 (`bench.engines`, an earlier build there). The probe graph, the widest ResNet exit,
is INT8's best case, and on that AVX2 CPU it came out 7 % slower on a quiet machine but 9 % faster while other
work ran beside the probe; hence INT8's bar of 20 %: only a machine where INT8 is clearly faster builds it.
A precision that cannot pay is not built unless asked for (`--precisions`, `--all-precisions`); FP32, the
reference, always is. The probe times the engines in interleaved rounds, so drift of a shared machine hits them
alike; its numbers are recorded in ladder.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from engines.base import Precision
from engines.factory import open_engine
from engines.manifest import Probe, ProbeEngine, accuracy_stderr
from engines.steps.context import BuildContext, machine_key
from engines.steps.evaluate import accuracy, engine_logits
from engines.steps.export import fp16_file
from engines.steps.graphs import BF16, FP16, FP32, INT8, EngineKind, Graph
from engines.steps.measure import time_interleaved

OPTIONAL = (BF16, FP16)
RULE = (
    "a precision besides FP32 is built only if, on the probe graph, its batch-1 p50 is at least {min_speedup:.0%} "
    "(INT8: {int8_min_speedup:.0%}) below FP32's, and (BF16, FP16) a paying INT8 does not dominate it (INT8 slower "
    "at batch 1, or less accurate on val by more than {tie_se:g} standard error)"
)


@dataclass(frozen=True)
class ProbeConfig:
    rounds: int = 5
    runs: int = 100  # timed batch-1 runs per engine and round
    warmup: int = 20
    min_speedup: float = 0.05
    int8_min_speedup: float = 0.2  # INT8 also risks accuracy, and its files take most of a build: clearly faster
    tie_se: float = 1.0  # val accuracies closer than this many standard errors are equal (as member cascades)

    def rule(self) -> str:
        return RULE.format(min_speedup=self.min_speedup, int8_min_speedup=self.int8_min_speedup, tie_se=self.tie_se)


def faster_than_fp32(p50: dict[Precision, float], precision: Precision, min_speedup: float) -> bool:
    return p50[precision] <= (1 - min_speedup) * p50[Precision.FP32]


def decide(
    p50: dict[Precision, float],
    val: dict[Precision, float | None],
    min_speedup: float,
    int8_min_speedup: float = ProbeConfig.int8_min_speedup,
    val_images: int = 0,
    tie_se: float = ProbeConfig.tie_se,
) -> dict[Precision, tuple[bool, str]]:
    """Rule 1 and 2 of the module doc for INT8 and every optional precision in `p50`; (pays, why) each.
    `val_images`: how many images the val accuracies were measured on (0: any difference counts)."""
    fp32, int8 = p50[Precision.FP32], p50[Precision.INT8]
    int8_pays = faster_than_fp32(p50, Precision.INT8, int8_min_speedup)
    out: dict[Precision, tuple[bool, str]] = {
        Precision.INT8: (
            int8_pays,
            f"{int8:.3f} ms at batch 1 is {int8 / fp32:.2f}x FP32's {fp32:.3f} ms "
            f"({'' if int8_pays else 'not '}{int8_min_speedup:.0%} faster or more)",
        )
    }
    for precision in (k.precision for k in OPTIONAL if k.precision in p50):
        ms = p50[precision]
        if not faster_than_fp32(p50, precision, min_speedup):
            out[precision] = (False, f"{ms:.3f} ms at batch 1 is not faster than FP32's {fp32:.3f} ms")
            continue
        acc, acc_int8 = val.get(precision), val.get(Precision.INT8)
        stderr = accuracy_stderr(acc or 0.0, val_images)
        if not int8_pays:
            out[precision] = (True, f"{ms:.3f} ms at batch 1: faster than FP32 ({fp32:.3f}); INT8 does not pay")
        elif ms < int8:
            out[precision] = (True, f"{ms:.3f} ms at batch 1: faster than FP32 ({fp32:.3f}) and INT8 ({int8:.3f})")
        elif acc is not None and acc_int8 is not None and acc > acc_int8 + tie_se * stderr:
            out[precision] = (
                True,
                f"faster than FP32 and more accurate than INT8 on val ({acc:.2%} vs {acc_int8:.2%}, "
                f"more than {tie_se:g} standard error of {stderr:.2%})",
            )
        else:
            out[precision] = (
                False,
                f"faster than FP32 ({ms:.3f} vs {fp32:.3f} ms) but INT8 dominates it: {int8:.3f} ms and "
                f"{acc_int8:.2%} on val vs {acc if acc is None else f'{acc:.2%}'} (within {tie_se:g} standard "
                f"error: {stderr:.2%})",
            )
    return out


def _engine_file(ctx: BuildContext, g: Graph, kind: EngineKind) -> Any:
    return fp16_file(ctx, g) if kind is FP16 else ctx.out / g.file(kind.file)


def run_probe(ctx: BuildContext, g: Graph, config: ProbeConfig) -> Probe:
    kinds = [FP32, INT8, *OPTIONAL]
    files = {k.precision: _engine_file(ctx, g, k) for k in kinds}
    key = {
        "files": {str(p): ctx.cache.sha256(f) for p, f in files.items()},
        "config": asdict(config),
        "rule": RULE,  # a changed rule decides again
        "threads": ctx.threads,
        "machine": machine_key(),
        "versions": ctx.versions,
    }

    def make() -> dict[str, Any]:
        engines = {k.precision: open_engine(k.backend, files[k.precision], k.precision, ctx.threads) for k in kinds}
        rounds = time_interleaved(engines, 1, config.rounds, config.runs, config.warmup)
        for e in engines.values():
            e.close()
        samples = {p: np.concatenate(r) for p, r in rounds.items()}
        p50 = {p: float(np.median(s)) for p, s in samples.items()}
        val_split = ctx.inputs.split("val")
        val: dict[Precision, float | None] = {}
        for k in kinds:
            # Accuracy is needed for rule 2 only (and FP32/INT8 are evaluated for their rungs anyway).
            if k in (FP32, INT8) or faster_than_fp32(p50, k.precision, config.min_speedup):
                logits = engine_logits(ctx, files[k.precision], k.backend, k.precision, ("val",))
                val[k.precision] = accuracy(logits["val"], val_split.labels)
        decisions = decide(p50, val, config.min_speedup, config.int8_min_speedup, len(val_split), config.tie_se)
        return Probe(
            graph=g.name,
            rule=config.rule(),
            engines=[
                ProbeEngine(
                    name=k.name(g.name),
                    precision=k.precision,
                    backend=k.backend,
                    p50_ms_batch1=p50[k.precision],
                    runs=len(samples[k.precision]),
                    val_accuracy=val.get(k.precision),
                )
                for k in kinds
            ],
            pays={str(p): d[0] for p, d in decisions.items()},
            reasons={str(p): d[1] for p, d in decisions.items()},
            built=[],
        ).model_dump(mode="json")

    return Probe.model_validate(ctx.cache.run(f"probe/{g.name}", key, make))


def built_precisions(probe: Probe, asked: tuple[Precision, ...] | None) -> list[Precision]:
    """FP32, plus the precisions that pay here, or (`asked`) exactly those that were asked for."""
    if asked is not None:
        chosen = {Precision.FP32, *asked}
    else:
        chosen = {Precision.FP32, *(Precision(p) for p, pays in probe.pays.items() if pays)}
    return [p for p in (Precision.FP32, Precision.INT8, Precision.BF16, Precision.FP16) if p in chosen]
