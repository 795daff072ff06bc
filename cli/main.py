"""The `anytime` command line.

Each subcommand lives in its own module and is imported only when it is the one asked for, so that
`anytime serve` never imports torch. Expected failures (bad arguments, missing inputs, refused targets)
print one line and exit 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# name: (module, function adding its arguments, one-line help, description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "train": (
        "cli.train",
        "add_train",
        "train a multi-exit model and write a checkpoint",
        "Train with a weighted joint loss over all exits; writes a checkpoint holding weights, config, "
        "preprocessing, split fingerprints, command and accuracy.",
    ),
    "evaluate": (
        "cli.train",
        "add_evaluate",
        "per-exit test accuracy and latency of a checkpoint",
        "Checks the checkpoint against the data, then prints per-exit test accuracy, parameters, MACs and "
        "torch latency percentiles at batch 1 and 32.",
    ),
    "build": (
        "cli.build",
        "add_build",
        "build a ladder: ONNX, INT8 engines, profiles, ladder.json",
        "Export every stage, exit and residual cut to ONNX, calibrate INT8 on the calib split, measure "
        "accuracy and latency of every engine, fit cascade thresholds and ensembles, and write ladder.json. "
        "A re-run redoes only what changed.",
    ),
    "serve": (
        "cli.serve",
        "add_serve",
        "serve a ladder over HTTP (FastAPI + uvicorn)",
        "Serve /v1/classify with deadline-aware planning. Every option can also be set as an ANYTIME_* "
        "environment variable (ANYTIME_LADDER, ANYTIME_PORT, ...; every one with its default: the README's Settings).",
    ),
    "loadtest": (
        "cli.load",
        "add_loadtest",
        "send labelled test images to a running server and measure attainment, accuracy, latency",
        "Open-loop Poisson load (--scenario server) or one request at a time (single-stream) against a "
        "running server; stops after --requests or --duration. Writes records.jsonl and summary.json to "
        "--out. Only loopback targets unless --allow-remote.",
    ),
    "sweep": (
        "cli.load",
        "add_sweep",
        "deadlines x policies x rates against a server it starts; report.md with plots",
        "Starts the server (and the plain baseline) on loopback, runs a short open-loop Poisson run per "
        "cell, computes the oracle bound offline, optionally searches each policy's capacity, and writes "
        "report.md, PNG plots, sweep.json and per-cell records to --out.",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s own arguments are added (and its module imported)."""
    parser = argparse.ArgumentParser(prog="anytime", description="Anytime inference: deadline-aware classification.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, add, help_text, description) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if name == command:
            getattr(importlib.import_module(module), add)(p)
    return parser


def expected_errors() -> tuple[type[BaseException], ...]:
    """What a user's input can cause: one line and exit 2, never a traceback."""
    from cli.args import UsageError
    from engines.base import ArtifactError, BackendUnavailable
    from engines.manifest import ManifestError
    from loadtest.client import RemoteTargetRefused
    from models.data import DataError

    errors: list[type[BaseException]] = [
        UsageError,
        DataError,
        ArtifactError,
        BackendUnavailable,
        ManifestError,
        RemoteTargetRefused,
    ]
    # Raised only by modules already imported, which need torch: an install without torch has none.
    if "models.checkpoint" in sys.modules:
        from models.checkpoint import CheckpointError

        errors.append(CheckpointError)
    if "models.registry" in sys.modules:
        from models.registry import UnknownModel

        errors.append(UnknownModel)
    if "engines.build" in sys.modules:
        from engines.build import BuildError

        errors.append(BuildError)
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(args_list)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except KeyboardInterrupt:
        print(f"anytime {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, expected_errors()):
            raise  # a bug: the traceback says where
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"anytime {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
