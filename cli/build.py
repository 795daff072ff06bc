"""`anytime build`: checkpoint -> ONNX graphs -> engines -> profiles -> ladder.json (engines/build.py does the work)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from cli.args import DATA_HELP, UsageError, positive
from cli.train import DEFAULT_CHECKPOINT
from engines.build import BuildConfig

DEFAULTS = {f.name: f.default for f in fields(BuildConfig)}


def add_build(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, nargs="?", default=DEFAULT_CHECKPOINT)
    p.add_argument("--out", type=Path, default=Path("ladders/default"), help="ladder directory (default: %(default)s)")
    p.add_argument("--data", default=DEFAULTS["data"], help=DATA_HELP)
    p.add_argument(
        "--threads",
        type=positive,
        default=DEFAULTS["threads"],
        help="threads per engine, measured and recorded (default: %(default)s)",
    )
    p.add_argument("--calib-samples", type=positive, default=DEFAULTS["calib_samples"], help="(default: %(default)s)")
    p.add_argument(
        "--calib-method",
        choices=["minmax", "entropy", "percentile"],
        help="default: the one with the best val accuracy",
    )
    p.add_argument(
        "--runs", type=positive, default=DEFAULTS["runs"], help="timed runs per latency profile (default: %(default)s)"
    )
    p.add_argument(
        "--bound-pp",
        type=float,
        default=DEFAULTS["accuracy_bound_pp"],
        help="cascade accuracy bound vs the last exit (pp)",
    )
    p.add_argument(
        "--members",
        type=Path,
        nargs="*",
        help="single-exit checkpoints to build as ensemble members (default: the committed DenseNet, "
        "MobileNetV2 and VGG; none: no ensembles)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> None:
    from calibration.quantize import CalibrationMethod
    from engines.build import DEFAULT_MEMBERS, build_ladder

    members = DEFAULT_MEMBERS if args.members is None else tuple(args.members)
    missing = [str(p) for p in members if not p.is_file()]
    if missing:
        raise UsageError(f"no member checkpoint at {', '.join(missing)}")
    if not args.checkpoint.is_file():
        raise UsageError(f"no checkpoint at {args.checkpoint}")
    config = BuildConfig(
        threads=args.threads,
        calib_samples=args.calib_samples,
        calib_method=CalibrationMethod(args.calib_method) if args.calib_method else None,
        runs=args.runs,
        accuracy_bound_pp=args.bound_pp,
        data=args.data,
        progress=not args.quiet,
        members=members,
    )
    ladder = build_ladder(args.checkpoint, args.out, config)
    print(
        f"wrote {args.out / 'ladder.json'}: {len(ladder.rungs)} rungs, {len(ladder.stages)} stages, "
        f"{len(ladder.cascades)} cascades, {len(ladder.ensembles)} ensembles in {ladder.build_seconds:.0f} s"
    )
    print(ladder_table(ladder))


def ladder_table(ladder) -> str:  # type: ignore[no-untyped-def]
    """One line per rung and cascade: accuracy and measured latency."""
    lines = [f"{'rung':<34} {'val':>7} {'test':>7} {'p50 b1 ms':>10} {'p99 b1':>8} {'p50 b32':>8} {'MB':>6}  note"]
    for r in ladder.rungs:
        b1, b32 = r.profile(1), r.profile(32)
        note = f"dominated by {r.dominated_by}" if r.dominated else ""
        lines.append(
            f"{r.name:<34} {r.val_accuracy:>7.2%} {r.test_accuracy:>7.2%} {b1.p50_ms:>10.3f} "
            f"{b1.p99_ms:>8.3f} {b32.p50_ms:>8.3f} {r.artifact.bytes / 1e6:>6.2f}  {note}"
        )
    for e in ladder.ensembles:
        b1, b32 = e.profile(1), e.profile(32)
        note = f"{e.stacker}, soft vote {e.soft_vote_test_accuracy:.2%}" + (
            f", dominated by {e.dominated_by}" if e.dominated else ""
        )
        lines.append(
            f"{e.name:<34} {e.val_accuracy:>7.2%} {e.test_accuracy:>7.2%} {b1.p50_ms:>10.3f} "
            f"{b1.p99_ms:>8.3f} {b32.p50_ms:>8.3f} {e.artifact.bytes / 1e6:>6.2f}  {note}"
        )
    for c in ladder.cascades:
        shares = "/".join(f"{s:.2f}" for s in c.expected_exit_share)
        lines.append(
            f"{c.name:<34} {c.val_accuracy:>7.2%} {c.test_accuracy:>7.2%} {c.expected_mean_ms:>10.3f} "
            f"{'':>8} {'':>8} {'':>6}  exit shares {shares}, last exit {c.test_last_exit_accuracy:.2%}"
        )
    return "\n".join(lines)
