"""The `anytime` command line. Each subcommand imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from models.checkpoint import DEFAULT_CHECKPOINT


class UsageError(Exception):
    """Bad arguments or missing inputs: reported as one line, exit status 2."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cmd_train(args: argparse.Namespace) -> None:
    from models.data import open_source
    from models.train import TrainConfig, train_to

    model_config: dict[str, object] = {}
    if args.widths:
        model_config["widths"] = args.widths
    if args.blocks:
        model_config["blocks"] = args.blocks
    if args.stem_stride:
        model_config["stem_stride"] = args.stem_stride
    source = open_source(args.data)
    model_config["num_classes"] = len(source.class_names)
    config = TrainConfig(
        model=args.model,
        model_config=model_config,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        exit_weights=args.exit_weights,
        seed=args.seed,
        threads=args.threads,
        limit=args.limit,
    )
    command = "anytime " + shlex.join(sys.argv[1:])
    ckpt = train_to(args.out, config, source, command)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {ckpt.train_seconds:.0f} s of training")
    for split in ("val", "test"):
        print(f"{split} accuracy per exit: " + ", ".join(f"{a:.2%}" for a in ckpt.accuracy[split]))


def cmd_evaluate(args: argparse.Namespace) -> None:
    from models.checkpoint import load_checkpoint
    from models.data import open_source
    from models.evaluate import evaluate_checkpoint

    source = open_source(args.data)
    ckpt = load_checkpoint(args.checkpoint, source)
    report = evaluate_checkpoint(ckpt, source, threads=args.threads, runs=args.runs)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(report["text"])


def cmd_build(args: argparse.Namespace) -> None:
    from calibration.quantize import CalibrationMethod
    from engines.build import BuildConfig, build_ladder

    config = BuildConfig(
        threads=args.threads,
        calib_samples=args.calib_samples,
        calib_method=CalibrationMethod(args.calib_method) if args.calib_method else None,
        runs=args.runs,
        accuracy_bound_pp=args.bound_pp,
        data=args.data,
    )
    if not args.checkpoint.is_file():
        raise UsageError(f"no checkpoint at {args.checkpoint}")
    ladder = build_ladder(args.checkpoint, args.out, config)
    print(
        f"wrote {args.out / 'ladder.json'}: {len(ladder.rungs)} rungs, {len(ladder.stages)} stages, "
        f"{len(ladder.cascades)} cascades in {ladder.build_seconds:.0f} s"
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
    for c in ladder.cascades:
        shares = "/".join(f"{s:.2f}" for s in c.expected_exit_share)
        lines.append(
            f"{c.name:<34} {c.val_accuracy:>7.2%} {c.test_accuracy:>7.2%} {c.expected_mean_ms:>10.3f} "
            f"{'':>8} {'':>8} {'':>6}  exit shares {shares}, last exit {c.test_last_exit_accuracy:.2%}"
        )
    return "\n".join(lines)


def cmd_serve(args: argparse.Namespace) -> None:
    import logging

    import uvicorn
    from pydantic import ValidationError

    from service.app import create_app
    from service.config import Settings

    overrides = {
        k: v
        for k, v in {"ladder": args.ladder, "host": args.host, "port": args.port, "threads": args.threads}.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        raise UsageError(f"bad setting {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level="info", timeout_graceful_shutdown=5
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anytime", description="Anytime inference: deadline-aware classification.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="train a multi-exit model and write a checkpoint",
        description="Train with a weighted joint loss over all exits; writes a checkpoint holding "
        "weights, config, preprocessing, split fingerprints, command and accuracy.",
    )
    p.add_argument("--model", default="resnet_exits", help="registered model name (default: %(default)s)")
    p.add_argument("--widths", type=_int_list, help="channels per stage, e.g. 48,96,192")
    p.add_argument("--blocks", type=_int_list, help="blocks per stage, e.g. 2,2,3")
    p.add_argument("--stem-stride", type=_positive, help="stride of the stem convolution")
    p.add_argument("--epochs", type=_positive, default=8)
    p.add_argument("--batch-size", type=_positive, default=128)
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate of the one-cycle schedule")
    p.add_argument("--exit-weights", type=_float_list, help="loss weight per exit (default: all 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive, default=2)
    p.add_argument("--limit", type=_positive, help="train on the first N training images only")
    p.add_argument("--data", default="fashion-mnist", help="fashion-mnist, fashion-mnist:DIR or folder:DIR")
    p.add_argument("--out", type=Path, required=True, help="checkpoint file to write")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "evaluate",
        help="per-exit test accuracy and latency of a checkpoint",
        description="Checks the checkpoint against the data, then prints per-exit test accuracy, "
        "parameters, MACs and torch latency percentiles at batch 1 and 32.",
    )
    p.add_argument("checkpoint", type=Path, nargs="?", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default="fashion-mnist", help="fashion-mnist, fashion-mnist:DIR or folder:DIR")
    p.add_argument("--threads", type=_positive, default=2)
    p.add_argument("--runs", type=_positive, default=200, help="timed runs per latency figure")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "build",
        help="build a ladder: ONNX, INT8/BF16/FP16 engines, profiles, ladder.json",
        description="Export every stage, exit and residual cut to ONNX, calibrate INT8 on the calib split, "
        "measure accuracy and latency of every engine, fit cascade thresholds, and write ladder.json. "
        "A re-run redoes only what changed.",
    )
    p.add_argument("checkpoint", type=Path, nargs="?", default=DEFAULT_CHECKPOINT)
    p.add_argument("--out", type=Path, default=Path("ladders/default"), help="ladder directory")
    p.add_argument("--data", default="fashion-mnist", help="fashion-mnist, fashion-mnist:DIR or folder:DIR")
    p.add_argument("--threads", type=_positive, default=2, help="threads per engine (recorded)")
    p.add_argument("--calib-samples", type=_positive, default=1000)
    p.add_argument(
        "--calib-method",
        choices=["minmax", "entropy", "percentile"],
        help="default: the one with the best val accuracy",
    )
    p.add_argument("--runs", type=_positive, default=200, help="timed runs per latency profile")
    p.add_argument("--bound-pp", type=float, default=0.5, help="cascade accuracy bound vs the last exit (pp)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser(
        "serve",
        help="serve a ladder over HTTP (FastAPI + uvicorn)",
        description="Serve /v1/classify with deadline-aware planning. Every option can also be "
        "set as an ANYTIME_* environment variable (ANYTIME_LADDER, ANYTIME_PORT, ...).",
    )
    p.add_argument("--ladder", type=Path, help="ladder directory (default: ladders/default)")
    p.add_argument("--host", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: 8000)")
    p.add_argument("--threads", type=_positive, help="threads per engine (default: 2)")
    p.set_defaults(func=cmd_serve)
    return parser


def _expected_errors() -> tuple[type[BaseException], ...]:
    from engines.base import ArtifactError, BackendUnavailable
    from engines.manifest import ManifestError
    from models.checkpoint import CheckpointError
    from models.data import DataError

    return (
        UsageError,
        DataError,
        CheckpointError,
        ArtifactError,
        BackendUnavailable,
        ManifestError,
        KeyError,
        ValueError,
        FileNotFoundError,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except _expected_errors() as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"anytime {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"anytime {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
