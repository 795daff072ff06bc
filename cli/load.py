"""`anytime loadtest` and `anytime sweep`: open-loop load against a server; deadlines x policies x rates."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from cli.args import UsageError, non_negative_float, positive, positive_float, positive_floats
from loadtest.client import MAX_CONNECTIONS, LoadConfig
from loadtest.results import SweepConfig

LOAD = {f.name: f.default for f in fields(LoadConfig)}
SWEEP = {f.name: f.default for f in fields(SweepConfig)}


def _add_load_options(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    p.add_argument(
        "--requests", type=positive, default=defaults["requests"], help="stop after this many (default: %(default)s)"
    )
    p.add_argument(
        "--duration",
        type=positive_float,
        default=defaults["duration_s"],
        help="... or after this many s of sending (default: %(default)s)",
    )
    p.add_argument("--on-infeasible", choices=["reject", "best_effort"], default=defaults["on_infeasible"])
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=defaults["timeout_s"],
        help="client timeout per request, s (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=defaults["seed"], help="seeds arrivals, deadlines and the image order")
    p.add_argument("--data", default="fashion-mnist", help="labelled test images: fashion-mnist[:DIR] or folder:DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_loadtest(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=LOAD["url"], help="the server (default: %(default)s)")
    p.add_argument("--allow-remote", action="store_true", help="allow a target outside loopback")
    p.add_argument("--scenario", choices=["server", "single-stream"], default=str(LOAD["scenario"]))
    p.add_argument(
        "--rate",
        type=positive_float,
        default=LOAD["rate"],
        help="Poisson arrivals per s (server scenario; default: %(default)s)",
    )
    deadline = p.add_mutually_exclusive_group()
    deadline.add_argument(
        "--deadline", type=positive_float, default=10.0, help="deadline_ms of every request (default: %(default)s)"
    )
    deadline.add_argument("--deadline-mix", help='deadline_ms:probability pairs, e.g. "3:0.3,10:0.5,50:0.2"')
    p.add_argument("--policy", choices=["auto", "cascade", "static", "fixed"], default=LOAD["policy"])
    p.add_argument("--rung", help="the rung, with --policy fixed")
    p.add_argument(
        "--body",
        choices=["json", "png"],
        default=LOAD["body"],
        help="json: base64 PNG in a JSON body; png: the PNG file as the body, options in the query string",
    )
    p.add_argument(
        "--connections",
        type=positive,
        default=LOAD["warm_connections"],
        help="keep-alive connections opened before the clock starts; more open as requests need them "
        "(default: %(default)s)",
    )
    _add_load_options(p, LOAD)
    p.add_argument("--out", type=Path, default=Path("reports/loadtest"), help="folder for records and summary")
    p.set_defaults(func=run_loadtest)


def add_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ladder", type=Path, default=Path("ladders/default"), help="ladder directory")
    p.add_argument(
        "--deadlines",
        type=positive_floats,
        default=SWEEP["deadlines_ms"],
        help="ms, e.g. 3,5,10,20 (default: %(default)s)",
    )
    rates = p.add_mutually_exclusive_group()
    rates.add_argument("--rates", type=positive_floats, default=SWEEP["rates"], help="req/s, e.g. 50,200")
    rates.add_argument(
        "--load",
        type=positive_floats,
        default=SWEEP["load"],
        help="percent of the capacity of auto, measured first (default: %(default)s; used without --rates)",
    )
    p.add_argument("--repeats", type=positive, default=SWEEP["repeats"], help="runs per cell (default: %(default)s)")
    p.add_argument(
        "--policies",
        default=",".join(SWEEP["policies"]),
        help="auto, static, cascade; front: every served option as fixed; fixed-fast: the rung with the lowest "
        "p99 at batch 1; fixed-best: the highest val accuracy; auto-bare / auto-unloaded / auto-rate-budget / "
        "auto-most-accurate / auto-server-late / auto-fastest-fallback: auto without caution / without the load "
        "budget / with the load budget but without its restraint / without ties / "
        "with caution counting only answers late at the server / with the quickest first step where caution leaves "
        "no option, each on a server of its own as auto is (side by side); auto-shared: auto on the server the "
        "fixed columns share; "
        "fixed:NAME: the ladder's option NAME; "
        "baseline: the plain server of loadtest/baseline.py (default: %(default)s)",
    )
    _add_load_options(p, SWEEP)
    p.add_argument(
        "--warmup",
        type=non_negative_float,
        default=SWEEP["warmup_s"],
        help="seconds of each cell's own load sent first and not scored, so that every server starts the cell warm "
        "(0: none; default: %(default)s)",
    )
    p.add_argument(
        "--steadiness",
        type=non_negative_float,
        default=SWEEP["steadiness_s"],
        help="seconds of the machine-steadiness probe (loadtest/steadiness.py) before and after the cells, in the "
        "report (0: none; default: %(default)s)",
    )
    p.add_argument("--capacity", action="store_true", help="also search each policy's capacity (MLPerf Server)")
    p.add_argument(
        "--capacity-deadline",
        type=positive_float,
        default=SWEEP["capacity_deadline_ms"],
        help="deadline of the search, ms",
    )
    p.add_argument(
        "--capacity-start", type=positive_float, default=SWEEP["capacity_start"], help="first rate tried, req/s"
    )
    p.add_argument("--out", type=Path, default=Path("reports/sweep"), help="report folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the stopped sweep in --out: the cells it finished are read back, not run again (same options "
        "and the same ladder.json, or it is refused)",
    )
    p.set_defaults(func=run_sweep)


def run_loadtest(args: argparse.Namespace) -> None:
    import datetime

    from loadtest.client import Scenario, check_target, run_load, write_run
    from loadtest.schedule import DeadlineMix
    from models.data import open_source

    check_target(args.url, args.allow_remote)  # RemoteTargetRefused: an expected error, one line
    if args.policy == "fixed" and not args.rung:
        raise UsageError("--policy fixed needs --rung (GET /v1/ladder lists the rungs)")
    if args.policy != "fixed" and args.rung:
        raise UsageError("--rung goes with --policy fixed only")
    if args.connections > MAX_CONNECTIONS:
        raise UsageError(f"--connections: at most {MAX_CONNECTIONS}")
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
        warm_connections=args.connections,
    )
    split = open_source(args.data).split("test")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
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


def run_sweep(args: argparse.Namespace) -> None:
    from engines.manifest import load_ladder
    from loadtest.journal import ResumeError
    from loadtest.sweep import policy_specs, save_sweep
    from loadtest.sweep import run_sweep as sweep
    from models.data import open_source

    if not (args.ladder / "ladder.json").is_file():
        raise UsageError(f"no ladder.json in {args.ladder}: build one with `anytime build --out {args.ladder}`")
    policies = tuple(p.strip() for p in args.policies.split(","))
    try:
        policy_specs(load_ladder(args.ladder), policies)  # a bad name is refused before any server starts
    except ValueError as e:
        raise UsageError(str(e)) from None
    config = SweepConfig(
        ladder=args.ladder,
        out=args.out,
        deadlines_ms=args.deadlines,
        rates=args.rates,
        load=args.load,
        repeats=args.repeats,
        policies=policies,
        requests=args.requests,
        duration_s=args.duration,
        warmup_s=args.warmup,
        on_infeasible=args.on_infeasible,
        timeout_s=args.timeout,
        seed=args.seed,
        capacity=args.capacity,
        capacity_deadline_ms=args.capacity_deadline,
        capacity_start=args.capacity_start,
        steadiness_s=args.steadiness,
        progress=not args.quiet,
    )
    try:
        result = sweep(config, open_source(args.data).split("test"), resume=args.resume)
    except ResumeError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        print(
            f"the finished cells are kept in {args.out}: the same command with --resume runs the rest",
            file=sys.stderr,
        )
        raise
    report = save_sweep(result)
    print(f"wrote {report} and its plots")
