"""`anytime train` and `anytime evaluate`: train a multi-exit model; report a checkpoint's accuracy and latency."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

from cli.args import DATA_HELP, UsageError, float_list, int_list, positive
from models.train import TrainConfig

# The same path as models.checkpoint.DEFAULT_CHECKPOINT (models.checkpoint itself needs no more than this).
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "checkpoints" / "resnet_exits_fmnist.pt"
DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULTS["model"], help="registered model name (default: %(default)s)")
    p.add_argument("--widths", type=int_list, help="channels per stage, e.g. 48,96,192")
    p.add_argument("--blocks", type=int_list, help="blocks per stage, e.g. 2,2,3")
    p.add_argument("--stem-stride", type=positive, help="stride of the stem convolution")
    p.add_argument("--epochs", type=positive, default=DEFAULTS["epochs"], help="(default: %(default)s)")
    p.add_argument("--batch-size", type=positive, default=DEFAULTS["batch_size"], help="(default: %(default)s)")
    p.add_argument(
        "--lr",
        type=float,
        default=DEFAULTS["lr"],
        help="peak learning rate of the one-cycle schedule (default: %(default)s)",
    )
    p.add_argument("--exit-weights", type=float_list, help="loss weight per exit (default: all 1)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="(default: %(default)s)")
    p.add_argument("--threads", type=positive, default=DEFAULTS["threads"], help="(default: %(default)s)")
    p.add_argument("--limit", type=positive, help="train on the first N training images only")
    p.add_argument(
        "--device",
        default=DEFAULTS["device"],
        help="where the model trains: cpu, or cuda (cuda:N) on an NVIDIA GPU through torch (default: %(default)s)",
    )
    p.add_argument("--init", type=Path, help="continue from this checkpoint's weights (its command is recorded too)")
    p.add_argument("--data", default="fashion-mnist", help=DATA_HELP)
    p.add_argument("--out", type=Path, required=True, help="checkpoint file to write")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> None:
    from models.data import open_source
    from models.train import train_to

    model_config: dict[str, object] = {}
    for key in ("widths", "blocks", "stem_stride"):
        if getattr(args, key):
            model_config[key] = getattr(args, key)
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
        init=args.init,
        device=args.device,
    )
    command = "anytime " + shlex.join(sys.argv[1:])
    try:
        ckpt = train_to(args.out, config, source, command)
    except ValueError as e:  # a model configuration that cannot be built (widths and blocks disagree, ...)
        raise UsageError(str(e)) from None
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {ckpt.train_seconds:.0f} s of training")
    for split in ("val", "test"):
        print(f"{split} accuracy per exit: " + ", ".join(f"{a:.2%}" for a in ckpt.accuracy[split]))


def add_evaluate(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, nargs="?", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default="fashion-mnist", help=DATA_HELP)
    p.add_argument("--threads", type=positive, default=DEFAULTS["threads"], help="(default: %(default)s)")
    p.add_argument("--runs", type=positive, default=200, help="timed runs per latency figure (default: %(default)s)")
    p.add_argument(
        "--limit",
        type=positive,
        help="accuracy on the first N test images only (the checkpoint records test[:1000]; default: all)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> None:
    from models.checkpoint import load_checkpoint
    from models.data import open_source
    from models.evaluate import evaluate_checkpoint

    source = open_source(args.data)
    ckpt = load_checkpoint(args.checkpoint, source)
    report = evaluate_checkpoint(ckpt, source, threads=args.threads, runs=args.runs, limit=args.limit)
    print(json.dumps(report, indent=2) if args.json else report["text"])
