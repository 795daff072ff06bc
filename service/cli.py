"""The `anytime` command line. Each subcommand imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# The same path as models.checkpoint.DEFAULT_CHECKPOINT, without importing torch for every command.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "checkpoints" / "resnet_exits_fmnist.pt"


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
        init=args.init,
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
    from engines.build import DEFAULT_MEMBERS, BuildConfig, build_ladder

    members = DEFAULT_MEMBERS if args.members is None else tuple(args.members)
    missing = [str(p) for p in members if not p.is_file()]
    if missing:
        raise UsageError(f"no member checkpoint at {', '.join(missing)}")
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
    if not args.checkpoint.is_file():
        raise UsageError(f"no checkpoint at {args.checkpoint}")
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


def cmd_serve(args: argparse.Namespace) -> None:
    import logging

    from pydantic import ValidationError

    from service.app import create_app
    from service.config import Settings
    from service.server import serve

    overrides = {
        k: v
        for k, v in {
            "ladder": args.ladder,
            "host": args.host,
            "port": args.port,
            "threads": args.threads,
            "access_log": args.access_log or None,
        }.items()
        if v is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        raise UsageError(f"bad setting {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(create_app(settings), settings)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def cmd_loadtest(args: argparse.Namespace) -> None:
    import datetime

    from loadtest.client import LoadConfig, Scenario, check_target, run_load, write_run
    from loadtest.schedule import DeadlineMix
    from models.data import open_source

    try:
        check_target(args.url, args.allow_remote)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.policy == "fixed" and not args.rung:
        raise UsageError("--policy fixed needs --rung (GET /v1/ladder lists the rungs)")
    if args.policy != "fixed" and args.rung:
        raise UsageError("--rung goes with --policy fixed only")
    deadlines = DeadlineMix.parse(args.deadline_mix) if args.deadline_mix else DeadlineMix.single(args.deadline)
    config = LoadConfig(
        url=args.url,
        scenario=Scenario(args.scenario),
        rate=args.rate,
        requests=args.requests,
        duration_s=args.duration,
        deadlines=deadlines,
        policy=args.policy,
        rung=args.rung,
        on_infeasible=args.on_infeasible,
        timeout_s=args.timeout,
        seed=args.seed,
        body=args.body,
    )
    split = open_source(args.data).split("test")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        records = run_load(config, split, progress=not args.quiet)
    except ConnectionError as e:
        raise UsageError(str(e)) from None
    m = write_run(args.out, config, records, started=started)["metrics"]
    if not m["sent"]:
        raise UsageError(f"no request was due within --duration {args.duration:g} s at --rate {args.rate:g}/s")
    s, c = m["server_latency_ms"], m["client_latency_ms"]
    print(
        f"{m['sent']} sent, {m['answered']} answered; attainment {m['attainment']:.1%}, effective accuracy "
        f"{m['effective_accuracy']:.1%}, rejected {m['rejection_rate']:.1%}, errors {m['error_rate']:.1%}"
    )
    if s["p50"] is not None:
        print(f"server latency p50/p90/p99 {s['p50']:.2f}/{s['p90']:.2f}/{s['p99']:.2f} ms", end="; ")
    print(f"client latency p50/p90/p99 {c['p50']:.2f}/{c['p90']:.2f}/{c['p99']:.2f} ms")
    print(f"wrote {args.out / 'records.jsonl'} and {args.out / 'summary.json'}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from loadtest.sweep import SweepConfig, run_sweep, save_sweep
    from models.data import open_source

    if not (args.ladder / "ladder.json").is_file():
        raise UsageError(f"no ladder.json in {args.ladder}: build one with `anytime build --out {args.ladder}`")
    config = SweepConfig(
        ladder=args.ladder,
        out=args.out,
        deadlines_ms=args.deadlines,
        rates=args.rates,
        policies=tuple(p.strip() for p in args.policies.split(",")),
        requests=args.requests,
        duration_s=args.duration,
        on_infeasible=args.on_infeasible,
        timeout_s=args.timeout,
        seed=args.seed,
        capacity=args.capacity,
        capacity_deadline_ms=args.capacity_deadline,
        capacity_start=args.capacity_start,
        progress=not args.quiet,
    )
    report = save_sweep(run_sweep(config, open_source(args.data).split("test")))
    print(f"wrote {report} and its plots")


def _positive_floats(text: str) -> tuple[float, ...]:
    values = _float_list(text)
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _add_load_options(p: argparse.ArgumentParser, requests: int, duration: float) -> None:
    p.add_argument("--requests", type=_positive, default=requests, help="stop after this many (default: %(default)s)")
    p.add_argument("--duration", type=_positive_float, default=duration, help="... or after this many s of sending")
    p.add_argument("--on-infeasible", choices=["reject", "best_effort"], default="reject")
    p.add_argument("--timeout", type=_positive_float, default=10.0, help="client timeout per request, s")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, deadlines and the image order")
    p.add_argument("--data", default="fashion-mnist", help="labelled test images: fashion-mnist[:DIR] or folder:DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


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
    p.add_argument("--init", type=Path, help="continue from this checkpoint's weights (its command is recorded too)")
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
    p.add_argument(
        "--threads", type=_positive, default=1, help="threads per engine, measured and recorded (default: %(default)s)"
    )
    p.add_argument("--calib-samples", type=_positive, default=1000)
    p.add_argument(
        "--calib-method",
        choices=["minmax", "entropy", "percentile"],
        help="default: the one with the best val accuracy",
    )
    p.add_argument("--runs", type=_positive, default=200, help="timed runs per latency profile")
    p.add_argument("--bound-pp", type=float, default=0.5, help="cascade accuracy bound vs the last exit (pp)")
    p.add_argument(
        "--members",
        type=Path,
        nargs="*",
        help="single-exit checkpoints to build as ensemble members (default: the committed DenseNet, "
        "MobileNetV2 and VGG; none: no ensembles)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
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
    p.add_argument("--threads", type=_positive, help="threads per engine (default: the ladder's)")
    p.add_argument("--access-log", action="store_true", help="log one line per request (default: off)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "loadtest",
        help="send labelled test images to a running server and measure attainment, accuracy, latency",
        description="Open-loop Poisson load (--scenario server) or one request at a time (single-stream) "
        "against a running server; stops after --requests or --duration. Writes records.jsonl and "
        "summary.json to --out. Only loopback targets unless --allow-remote.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--allow-remote", action="store_true", help="allow a target outside loopback")
    p.add_argument("--scenario", choices=["server", "single-stream"], default="server")
    p.add_argument("--rate", type=_positive_float, default=100.0, help="Poisson arrivals per s (server scenario)")
    deadline = p.add_mutually_exclusive_group()
    deadline.add_argument("--deadline", type=_positive_float, default=10.0, help="deadline_ms of every request")
    deadline.add_argument("--deadline-mix", help='deadline_ms:probability pairs, e.g. "3:0.3,10:0.5,50:0.2"')
    p.add_argument("--policy", choices=["cascade", "static", "fixed"], default="cascade")
    p.add_argument("--rung", help="the rung, with --policy fixed")
    p.add_argument(
        "--body",
        choices=["json", "png"],
        default="json",
        help="json: base64 PNG in a JSON body; png: the PNG file as the body, options in the query string",
    )
    _add_load_options(p, requests=1000, duration=10.0)
    p.add_argument("--out", type=Path, default=Path("reports/loadtest"), help="folder for records and summary")
    p.set_defaults(func=cmd_loadtest)

    p = sub.add_parser(
        "sweep",
        help="deadlines x policies x rates against a server it starts; report.md with plots",
        description="Starts the server (and the plain baseline) on loopback, runs a short open-loop Poisson "
        "run per cell, computes the oracle bound offline, optionally searches each policy's capacity, and "
        "writes report.md, PNG plots, sweep.json and per-cell records to --out.",
    )
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"), help="ladder directory")
    p.add_argument("--deadlines", type=_positive_floats, default=(3.0, 5.0, 10.0, 20.0), help="ms, e.g. 3,5,10,20")
    p.add_argument("--rates", type=_positive_floats, default=(50.0, 200.0), help="req/s, e.g. 50,200")
    p.add_argument(
        "--policies",
        default="cascade,static,fixed-fast,fixed-best,baseline",
        help="fixed-fast: the rung with the lowest p99 at batch 1; fixed-best: the highest val accuracy; "
        "baseline: the plain server of loadtest/baseline.py (default: %(default)s)",
    )
    _add_load_options(p, requests=200, duration=5.0)
    p.add_argument("--capacity", action="store_true", help="also search each policy's capacity (MLPerf Server)")
    p.add_argument("--capacity-deadline", type=_positive_float, default=10.0, help="deadline of the search, ms")
    p.add_argument("--capacity-start", type=_positive_float, default=25.0, help="first rate tried, req/s")
    p.add_argument("--out", type=Path, default=Path("reports/sweep"), help="report folder")
    p.set_defaults(func=cmd_sweep)
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
