"""Engine benchmark: per exit, latency ratios INT8/FP32, FP16/FP32 and BF16/FP32 at batch 1 and 32, and
accuracy deltas, all measured in this one run on the built ladder; with the ladder's TensorRT plans (built with
`--backend tensorrt`), their FP32, FP16 and INT8 latencies as ratios of ONNX Runtime FP32 on the CPU too.

Method: each engine is loaded with the ladder's thread count, warmed up (20 runs), then timed for
`--runs` calls on one random batch; figures are p50 wall times. The engines of one exit are measured
in an interleaved order (round robin, several rounds) so drift of a shared, noisy machine hits all alike.
Accuracy is top-1 on the full 10,000-image test split, recomputed here.

    python -m bench.engines [--ladder ladders/default] [--runs 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from engines.base import Backend, Engine, Precision
from engines.factory import open_engine
from engines.manifest import Ladder, load_ladder
from engines.steps.evaluate import accuracy, predict_logits
from engines.steps.export import convert_fp16
from engines.steps.measure import ProfileConfig, measure_latency
from models.data import FashionMNIST, PreprocessSpec

VARIANTS = [("fp32", "onnxruntime"), ("int8", "onnxruntime"), ("fp16", "onnxruntime"), ("bf16", "openvino")]
# TensorRT plans are timed only where the ladder has them (`anytime build --backend tensorrt` on the GPU that runs
# them): a plan is built for one GPU and TensorRT version, never here on the fly.
PLANS = [("fp32", "tensorrt"), ("fp16", "tensorrt"), ("int8", "tensorrt")]


def _open(directory: Path, ladder: Ladder, k: int, precision: str, backend: str) -> tuple[int, Engine] | None:
    """(file bytes, engine) of exit k; precisions the probe did not build are made here from the FP32 file,
    except INT8, which needs calibration: None when the build quantized no file of this exit (where INT8 does
    not pay, only the probe's graph, the last exit, is quantized)."""
    name = f"exit{k}.{precision}.{backend}"
    rec = next((r for r in ladder.rungs if r.name == name), None)
    if rec is not None:
        engine = open_engine(rec.backend, directory / rec.artifact.path, rec.precision, ladder.threads)
        return rec.artifact.bytes, engine
    if backend == Backend.TENSORRT:
        return None
    path = directory / f"exit{k}.fp32.onnx"
    if precision == "int8":
        path = directory / f"exit{k}.int8.onnx"
        if not path.is_file():
            return None
    if precision == "fp16":
        path = convert_fp16(path, Path(tempfile.mkdtemp()) / f"exit{k}.fp16.onnx")
    return path.stat().st_size, open_engine(Backend(backend), path, Precision(precision), ladder.threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ladder = load_ladder(args.ladder)
    spec = PreprocessSpec.from_dict(ladder.preprocess)
    test = FashionMNIST().split("test")
    exits = sorted({r.exit for r in ladder.rungs if r.kind == "exit"})
    print(
        f"ladder {args.ladder} ({ladder.machine['cpu']}, {ladder.threads} threads); p50 of {args.runs} runs x "
        f"{args.rounds} interleaved rounds; test accuracy on {len(test)} images"
    )
    print(
        f"{'exit':>4} {'variant':<17} {'b1 ms':>8} {'b32 ms':>8} {'b1 ratio':>9} {'b32 ratio':>10} {'test acc':>9} "
        f"{'delta pp':>9} {'MB':>6}"
    )
    last_fp32: dict[int, float] = {}
    has_plans = any(r.backend is Backend.TENSORRT for r in ladder.rungs)
    for k in exits:
        engines = {}
        if not has_plans:
            print(f"{k:>4} {'tensorrt':<17} no plans in this ladder (anytime build --backend tensorrt)")
        for precision, backend in VARIANTS + (PLANS if has_plans else []):
            opened = _open(args.ladder, ladder, k, precision, backend)
            if opened is None and backend == Backend.TENSORRT:
                print(f"{k:>4} {precision + '/' + backend:<17} no plan of this exit in the ladder")
            elif opened is None:
                why = ladder.probe.reasons.get(precision, "") if ladder.probe else ""
                print(f"{k:>4} {precision + '/' + backend:<17} not built on this machine (probe: {why})")
            else:
                engines[(precision, backend)] = opened
        times: dict[tuple[str, str], dict[int, list[float]]] = {v: {1: [], 32: []} for v in engines}
        for _ in range(args.rounds):
            for variant, (_, engine) in engines.items():
                for batch in (1, 32):
                    times[variant][batch].append(measure_latency(engine, batch, ProfileConfig.fixed(args.runs)).p50_ms)
        p50 = {v: {b: float(np.median(t)) for b, t in bt.items()} for v, bt in times.items()}
        acc = {v: accuracy(predict_logits(e, test, spec), test.labels) for v, (_, e) in engines.items()}
        base = ("fp32", "onnxruntime")
        last_fp32[k] = p50[base][1]
        for variant, (size, _) in engines.items():
            print(
                f"{k:>4} {variant[0] + '/' + variant[1]:<17} {p50[variant][1]:>8.3f} {p50[variant][32]:>8.3f} "
                f"{p50[variant][1] / p50[base][1]:>9.2f} {p50[variant][32] / p50[base][32]:>10.2f} "
                f"{acc[variant]:>9.2%} {100 * (acc[variant] - acc[base]):>+9.2f} {size / 1e6:>6.2f}"
            )
    last = exits[-1]
    for k in exits[:-1]:
        print(f"exit {k} / exit {last} FP32 latency at batch 1: {last_fp32[k] / last_fp32[last]:.2f}")


if __name__ == "__main__":
    main()
