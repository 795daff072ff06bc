"""The converter: checkpoint -> ONNX -> INT8 (and what else pays here) engines -> measured profiles -> ladder.json.

`python -m engines.build` and `anytime build` are the same command (`add_build_arguments`, `run_build`).
This module only orchestrates; each step lives in engines/steps/ with its own config, and every step's
result is keyed by content hashes in `build-cache.json` (engines/steps/cache.py), so a re-run with nothing
changed does no work:

    cut search -> graphs -> export (process pool) -> calibration method -> probe (on the last exit: which
    precisions besides FP32 pay here) -> INT8 of every graph where it pays (process pool) -> accuracy
    -> FP32 rungs -> cut front -> other rungs and members
    -> cascades -> [TensorRT plans, their rungs and cascades] -> ensemble search, stackers -> Pareto marks
    -> ladder.json -> rung table

With `backend=tensorrt` (`--backend tensorrt`, or `auto` on a machine with TensorRT and a GPU) the ONNX
Runtime ladder is built as always (calibration, the cut search and the ensembles rest on it) and FP32, FP16
and INT8 plans of every rung and stage are added (engines/steps/plan_rungs.py); the planner serves whichever
is faster at a request's deadline.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from calibration.quantize import CalibrationMethod
from engines.base import ArtifactError, Backend, BackendUnavailable, Precision
from engines.ensemble import StackerKind
from engines.manifest import CutSearch, EngineRecord, Ladder, ManifestError, Rung
from engines.steps.cache import StepCache
from engines.steps.calibrate import CalibrationConfig, choose_method, quantize_graphs
from engines.steps.cascades import CascadeConfig, build_cascade
from engines.steps.context import BuildContext, default_workers, software_versions
from engines.steps.cuts import CutConfig, exported_cuts, search_cuts
from engines.steps.ensembles import EnsembleConfig, build_ensembles, ensemble_bases
from engines.steps.evaluate import Background, exit_logits_via_chain
from engines.steps.export import export_graphs, fp16_file
from engines.steps.graphs import (
    CPU_ENGINES,
    FP16,
    FP32,
    INT8,
    KIND_ORDER,
    BuildError,
    EngineKind,
    Graph,
    load_inputs,
    plan_graphs,
)
from engines.steps.measure import ProfileConfig, machine_info
from engines.steps.member_cascades import MemberCascadeConfig, build_member_cascades
from engines.steps.pareto import keep_pareto_cuts, keep_pareto_ensembles
from engines.steps.plan_rungs import PlanConfig, build_plans, choose_backend, plan_rungs
from engines.steps.probe import ProbeConfig, built_precisions, run_probe
from engines.steps.report import ladder_table, summary
from engines.steps.rungs import make_rung, steady_batch1
from engines.steps.stacker import stacker_versions
from models.checkpoint import DEFAULT_CHECKPOINT, CheckpointError
from models.data import DataError

# The ensemble members built beside the main checkpoint by default (committed; README says how they were trained).
DEFAULT_MEMBERS = (
    DEFAULT_CHECKPOINT.parent / "densenet_fmnist.pt",
    DEFAULT_CHECKPOINT.parent / "mobilenetv2_fmnist.pt",
    DEFAULT_CHECKPOINT.parent / "vgg_fmnist.pt",
)


@dataclass
class BuildConfig:
    """Everything a build can be told; each step gets its own typed slice (`profile()`, `cuts()`, ...)."""

    # Intra-op threads per engine: what the server runs with (its default is the ladder's). One thread was
    # faster at batch 1 than two on our 2-vCPU machines (ONNX Runtime: exit 1 INT8 0.063 vs 0.080 ms) and
    # leaves the other core to the server's event loop; under load two threads per engine fought the loop.
    threads: int = 1
    calib_samples: int = 1000
    calib_method: CalibrationMethod | None = None  # None: the method with the best val accuracy
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    # The most timed runs per latency profile (the cap of the stop rule); 200 as `anytime build --runs` has it.
    runs: int = 200
    min_runs: int = 50  # the floor of the stop rule
    max_seconds: float = 0.5  # a profile stops after this long once past the floor
    accuracy_bound_pp: float = 0.5
    min_cuts: int = 3
    max_cut_drop_pp: float = 5.0  # a cut variant this far below the full network's val accuracy is never kept
    data: str = "fashion-mnist"
    progress: bool = True
    members: tuple[Path, ...] = DEFAULT_MEMBERS  # single-exit checkpoints for ensembles; () builds none
    # Each member's mirror view (the member on the image flipped left to right) joins as a member too. For tasks
    # whose labels survive a left-right flip, as `anytime train`'s augmentation assumes; off where they do not.
    mirror_views: bool = True
    int8_max_drop_pp: float = 1.0  # a member whose INT8 rung loses more val accuracy joins ensembles in FP32
    stacker_seed: int = 0
    precisions: tuple[Precision, ...] | None = None  # None: FP32 and what the probe says pays here
    workers: int = field(default_factory=default_workers)  # processes for export and calibration
    eval_threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # accuracy passes are never timed
    ensemble_starts: str = "every"
    stackers: tuple[StackerKind, ...] = tuple(StackerKind)  # ensemble stackers: chosen among these by CV on val
    # Member cascades (engines/steps/member_cascades.py): answers may differ from running every member on at
    # most this % of val; up to this many members; of the front, the cheapest of each group of val accuracies
    # within member_tie_se paired standard errors, up to member_cascades_kept.
    member_bound_pp: float = 0.1
    max_members: int = 3
    member_cascades_kept: int = 5
    member_tie_se: float = 1.0
    member_cost_tie: float = 0.10  # ... and of those, expected costs within 10 % of the cheapest's are equal too
    backend: Backend = Backend.ONNXRUNTIME  # TENSORRT: add TensorRT plan rungs and cascades (needs a GPU)

    def profile(self) -> ProfileConfig:
        return ProfileConfig(
            threads=self.threads,
            batch_sizes=tuple(self.batch_sizes),
            min_runs=min(self.min_runs, self.runs),
            max_runs=self.runs,
            max_seconds=self.max_seconds,
        )

    def cuts(self) -> CutConfig:
        return CutConfig(min_cuts=self.min_cuts, max_drop_pp=self.max_cut_drop_pp)

    def calibration(self) -> CalibrationConfig:
        return CalibrationConfig(samples=self.calib_samples, method=self.calib_method)

    def cascade(self) -> CascadeConfig:
        return CascadeConfig(accuracy_bound_pp=self.accuracy_bound_pp)

    def member_cascades(self) -> MemberCascadeConfig:
        return MemberCascadeConfig(
            self.max_members, self.member_bound_pp, self.member_cascades_kept, self.member_tie_se, self.member_cost_tie
        )

    def ensembles(self) -> EnsembleConfig:
        return EnsembleConfig(
            int8_max_drop_pp=self.int8_max_drop_pp,
            seed=self.stacker_seed,
            starts=self.ensemble_starts,
            stackers=self.stackers,
        )

    def plans(self) -> PlanConfig:
        return PlanConfig(batch_sizes=tuple(self.batch_sizes), calib_samples=self.calib_samples)

    def probe(self) -> ProbeConfig:
        return ProbeConfig()

    def measuring_key(self) -> dict[str, Any]:
        """What the ladder records about how every profile was measured."""
        return {**self.profile().key(), "runs": self.runs, "rule": "engines/steps/measure.py: ProfileConfig"}


def open_context(checkpoint: Path, out: Path, config: BuildConfig) -> BuildContext:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    torch.set_flush_denormal(True)
    return BuildContext(
        out=out,
        cache=StepCache(out),
        inputs=load_inputs(Path(checkpoint), config.data, tuple(config.members), config.mirror_views),
        data=config.data,
        threads=config.threads,
        eval_threads=config.eval_threads,
        workers=config.workers,
        progress=config.progress,
        versions=software_versions(),
    )


def _export(ctx: BuildContext, graphs: list[Graph], evals: Background) -> None:
    """Export one graph at a time, handing each answering graph's FP32 file to the background evaluations."""
    for g in ctx.bar(graphs, "export ONNX"):
        export_graphs(ctx, [g])
        if g.kind not in ("stage", "exit"):  # exits: from the stage chain (exit_logits_via_chain)
            evals.logits(ctx.out / g.file(FP32.file), FP32.backend, FP32.precision)


def _chain(ctx: BuildContext, stages: list[Graph], kind: EngineKind) -> list[tuple[Path, Backend, Precision]]:
    return [(ctx.out / kind.artifact(g), kind.backend, kind.precision) for g in stages]


class _Phases:
    """Wall time of the build's phases: logged as they end, recorded in ladder.json (build_steps, wall.*)."""

    def __init__(self, ctx: BuildContext, start: float) -> None:
        self.ctx, self.last, self.seconds = ctx, start, {"start": time.perf_counter() - start}

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self.last
        self.last = now
        self.ctx.log(f"{phase}: {self.seconds[phase]:.1f} s")


def _by_kind(graphs: list[Graph], kind: str) -> list[Graph]:
    return [g for g in graphs if g.kind == kind]


# Errors of the disk or the directory rather than of the build: a full disk, a read-only or forbidden directory.
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def build_ladder(checkpoint: Path, out: Path, config: BuildConfig | None = None) -> Ladder:
    """Build the ladder into `out`. The manifest is written last and atomically, so a build that fails leaves
    the previous `ladder.json` (if any) in place, and the sha256 checks refuse any of its files that changed."""
    try:
        return _build(checkpoint, out, config or BuildConfig())
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        raise BuildError(
            f"cannot write the ladder to {out}: {e.strerror or e}{where}; no new ladder.json was written"
        ) from e


def _build(checkpoint: Path, out: Path, config: BuildConfig) -> Ladder:
    start = time.perf_counter()
    choose_backend(config.backend)  # a TensorRT build without TensorRT or a GPU stops here, before any work
    ctx = open_context(checkpoint, out, config)
    profile = config.profile()
    phases = _Phases(ctx, start)

    # Accuracy passes (ONNX Runtime, GIL released) run in a background thread beside export, the cut search
    # and calibration (mostly Python on one core); nothing is timed until they are done. Once calibration is
    # done the main thread takes what is left of them (Background.wait), and of the INT8 passes after it.
    fp32_evals, int8_evals = Background(ctx), Background(ctx, workers=max(1, ctx.eval_threads - 1))
    base = plan_graphs(ctx.inputs, [])
    stages, exits, members = (_by_kind(base, k) for k in ("stage", "exit", "member"))
    _export(ctx, stages + exits + members, fp32_evals)
    fp32_evals.chain(_chain(ctx, stages, FP32))
    full, path = search_cuts(ctx, config.cuts())
    cuts = plan_graphs(ctx.inputs, exported_cuts(full, path, config.cuts()), base=False)
    _export(ctx, cuts, fp32_evals)
    calibration = choose_method(ctx, exits[-1], config.calibration())
    # The probe decides which precisions can pay here, INT8 among them, before the other graphs are quantized:
    # where INT8 is slower than FP32 (some x86 CPUs without VNNI) its files, evaluations and profiles would be wasted.
    # It times engines, so the FP32 evaluations finish first (beside them, on a busy 2-vCPU machine, an
    # OpenVINO engine came out 29 % faster than ONNX Runtime's FP32 one, against 1 % on a quiet machine).
    quantize_graphs(ctx, [exits[-1]], calibration.method, config.calibration())
    fp32_evals.wait()
    exit_logits_via_chain(ctx, _chain(ctx, stages, FP32), [ctx.out / g.file(FP32.file) for g in exits])
    probe = run_probe(ctx, exits[-1], config.probe())
    probe.built = built_precisions(probe, config.precisions)
    kinds = [CPU_ENGINES[p] for p in probe.built]
    ctx.log(f"precisions built: {', '.join(probe.built)} ({config.probe().rule()})")
    int8 = INT8 in kinds
    quantized = stages + exits + cuts + members if int8 or config.backend is Backend.TENSORRT else [exits[-1]]
    # INT8 passes start once every file is quantized: beside quantization they slowed it from 15 s to 29 s
    # (its calibration sessions, the FP32 passes and two INT8 passes on two cores) and gained nothing.
    quantize_graphs(ctx, quantized, calibration.method, config.calibration())  # TensorRT's INT8 plans need them
    if int8:
        for g in exits + cuts + members:
            int8_evals.logits(ctx.out / g.file(INT8.file), INT8.backend, INT8.precision)
        int8_evals.chain(_chain(ctx, stages, INT8))
    phases.done("export, cut search, calibration, FP32 accuracy, probe, INT8 files")
    int8_evals.wait()
    phases.done("INT8 accuracy")

    # Cut variants off the FP32 accuracy/latency front are dropped before any other engine is made.
    fp32 = [make_rung(ctx, g, FP32, profile) for g in ctx.bar(exits + cuts, "measure FP32 rungs")]
    fp32, kept = keep_pareto_cuts(fp32, config.min_cuts, config.max_cut_drop_pp)
    answering = exits + [g for g in cuts if g.name in kept]
    if FP16 in kinds:
        for g in answering:
            fp16_file(ctx, g)
    others = [(g, k) for g in answering for k in kinds if k is not FP32]
    rungs: list[Rung] = fp32 + [make_rung(ctx, g, k, profile) for g, k in ctx.bar(others, "measure other rungs")]
    # Members get the precisions ensembles use (FP32, and INT8 where it pays), measured like any rung.
    pairs = [(g, k) for g in members for k in (FP32, INT8) if k in kinds]
    rungs += [make_rung(ctx, g, k, profile) for g, k in ctx.bar(pairs, "measure member rungs")]
    rungs = steady_batch1(ctx, rungs, profile, "rungs")  # batch 1 again, every rung in interleaved rounds
    rungs.sort(key=lambda r: (KIND_ORDER[r.kind], r.name))  # exits, then cuts, then members; by name
    phases.done("rungs")

    stage_records, cascades = [], []
    for kind in ctx.bar([k for k in kinds if k is not FP16], "measure cascades"):
        records, cascade = build_cascade(ctx, stages, kind, config.cascade(), profile)
        stage_records += records
        cascades.append(cascade)
    phases.done("cascades")

    target: dict[str, str] = {}
    if config.backend is Backend.TENSORRT:
        target = build_plans(ctx, stages + answering + members, config.plans())
        plans, plan_stages, plan_cascades = plan_rungs(ctx, answering + members, stages, profile, config.cascade())
        rungs = sorted(rungs + plans, key=lambda r: (KIND_ORDER[r.kind], r.name))
        stage_records += plan_stages
        cascades += plan_cascades
        phases.done("tensorrt")

    measured, pruned = build_ensembles(ctx, rungs, exits[-1].name, config.ensembles(), profile)
    ensembles, tried = keep_pareto_ensembles(rungs, measured, pruned)
    phases.done("ensembles")

    bases = ensemble_bases(ctx, rungs, exits[-1].name, config.ensembles()) if members else []
    member_cascades = build_member_cascades(ctx, rungs, bases, ensembles, config.member_cascades())
    phases.done("member cascades")

    ladder = Ladder(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        checkpoint=ctx.inputs.artifact,
        model=ctx.inputs.checkpoint.model_name,
        network_config=ctx.inputs.checkpoint.model_config,
        class_names=ctx.inputs.checkpoint.class_names,
        preprocess=ctx.inputs.spec.to_dict(),
        data_source=ctx.inputs.source.source_id,
        splits=ctx.inputs.checkpoint.splits,
        split_sizes={name: len(ctx.inputs.split(name).labels) for name in ("val", "test")},
        threads=config.threads,
        measuring=config.measuring_key(),
        machine={**machine_info(), **({"gpu": target["gpu"]} if target else {})},
        software={
            **ctx.versions,
            **(stacker_versions() if ensembles else {}),
            **({"tensorrt": target["tensorrt"], "cuda": target["cuda"]} if target else {}),
        },
        calibration=calibration,
        cut_search=CutSearch(steps=path, kept=kept),
        stages=stage_records,
        cascades=cascades,
        rungs=rungs,
        ensembles=ensembles,
        ensemble_search=tried,
        member_cascades=member_cascades,
        tensorrt_sources=[ctx.artifact(ctx.out / g.file(Precision.INT8, True)) for g in stages + answering + members]
        if len(quantized) > 1
        else [],
        probe=probe,
        build_steps={
            "ran": len(ctx.cache.ran),
            "skipped": len(ctx.cache.skipped),
            **{f"seconds.{k}": round(v, 2) for k, v in sorted(ctx.cache.seconds.items())},
            **{f"wall.{k}": round(v, 2) for k, v in phases.seconds.items()},
        },
    )
    ladder.build_seconds = time.perf_counter() - start
    ladder.save(ctx.out)
    return ladder


# -- the command line (shared with `anytime build`) ----------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _precisions(text: str) -> tuple[Precision, ...]:
    try:
        return tuple(Precision(p.strip().lower()) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected precisions among {', '.join(Precision)}, got {text!r}") from None


def add_build_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `anytime build` / `python -m engines.build`."""
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
    p.add_argument(
        "--runs",
        type=_positive,
        default=BuildConfig.runs,
        help="the most timed runs per latency profile (default: %(default)s); profiles stop earlier once "
        "their p99 is stable (engines/steps/measure.py)",
    )
    p.add_argument("--min-runs", type=_positive, default=BuildConfig.min_runs, help="the fewest (default: %(default)s)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=BuildConfig.max_seconds,
        help="a latency profile stops after this long once past --min-runs (default: %(default)s)",
    )
    p.add_argument("--bound-pp", type=float, default=0.5, help="cascade accuracy bound vs the last exit (pp)")
    p.add_argument(
        "--member-bound-pp",
        type=float,
        default=BuildConfig.member_bound_pp,
        help="member cascades: %% of val answers that may differ from running every member (default: %(default)s)",
    )
    p.add_argument(
        "--member-cascades",
        type=_positive,
        default=BuildConfig.member_cascades_kept,
        help="member cascades kept at most, from the val accuracy / expected cost front (default: %(default)s)",
    )
    p.add_argument(
        "--member-tie-se",
        type=float,
        default=BuildConfig.member_tie_se,
        help="member cascades: val accuracies within this many paired standard errors count as equal and only the "
        "cheapest is kept, as auto chooses (0: the most accurate; default: %(default)s)",
    )
    p.add_argument(
        "--member-cost-tie",
        type=float,
        default=BuildConfig.member_cost_tie,
        help="member cascades: of those tied on val, expected costs within this fraction of the cheapest's count as "
        "equal too and the most accurate on val is kept (0: the cheapest; default: %(default)s)",
    )
    p.add_argument(
        "--members",
        type=Path,
        nargs="*",
        help="single-exit checkpoints to build as ensemble members (default: the committed DenseNet, "
        "MobileNetV2 and VGG; none, or the flag alone: no ensembles)",
    )
    p.add_argument(
        "--no-mirror-views",
        dest="mirror_views",
        action="store_false",
        help="do not add each member's mirror view (the member run on the image flipped left to right) as a "
        "member: for tasks where a flipped image has another label, e.g. digits or text",
    )
    precisions = p.add_mutually_exclusive_group()
    precisions.add_argument(
        "--precisions",
        type=_precisions,
        help="build exactly these precisions besides FP32, e.g. int8 or int8,bf16 (default: those the probe "
        "finds can pay on this machine; INT8 pays on x86 CPUs with VNNI, on some with AVX2 alone)",
    )
    precisions.add_argument("--all-precisions", action="store_true", help="build FP32, INT8, BF16 and FP16")
    p.add_argument(
        "--backend",
        choices=["onnxruntime", "tensorrt", "auto"],
        default="onnxruntime",
        help="onnxruntime: CPU engines only; tensorrt: also FP32, FP16 and INT8 TensorRT plans of every rung and "
        "cascade stage (needs TensorRT and an NVIDIA GPU); auto: tensorrt where both are here, else onnxruntime "
        "(default: %(default)s)",
    )
    p.add_argument("--workers", type=_positive, default=default_workers(), help="processes for export and calibration")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> BuildConfig:
    # `--members` alone or `--members none` (what an environment variable can carry): no ensembles.
    none = [str(m).lower() for m in args.members or ()] == ["none"]
    members = DEFAULT_MEMBERS if args.members is None else () if none else tuple(args.members)
    missing = [str(p) for p in (args.checkpoint, *members) if not Path(p).is_file()]
    if missing:
        raise BuildError(f"no checkpoint at {', '.join(missing)}")
    precisions = tuple(Precision) if args.all_precisions else args.precisions
    backend, reason = choose_backend(args.backend)  # before any work: a missing GPU is one line, exit 2
    if args.backend == "auto":
        print(f"backend {reason}", file=sys.stderr)
    return BuildConfig(
        threads=args.threads,
        calib_samples=args.calib_samples,
        calib_method=CalibrationMethod(args.calib_method) if args.calib_method else None,
        runs=args.runs,
        min_runs=args.min_runs,
        max_seconds=args.max_seconds,
        accuracy_bound_pp=args.bound_pp,
        member_bound_pp=args.member_bound_pp,
        member_cascades_kept=args.member_cascades,
        member_tie_se=args.member_tie_se,
        member_cost_tie=args.member_cost_tie,
        data=args.data,
        progress=not args.quiet,
        members=members,
        mirror_views=args.mirror_views,
        precisions=precisions,
        workers=args.workers,
        backend=backend,
    )


def run_build(args: argparse.Namespace) -> Ladder:
    """Build as the parsed options say, then print what was written and the rung table."""
    ladder = build_ladder(args.checkpoint, args.out, config_from_args(args))
    print(summary(ladder, str(args.out)))
    print(ladder_table(ladder))
    return ladder


EXPECTED_ERRORS = (
    BuildError,
    CheckpointError,
    DataError,
    ArtifactError,
    BackendUnavailable,
    ManifestError,
    FileNotFoundError,
    ValueError,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engines.build",  # the same command as `anytime build`
        description="Build a ladder: export every stage, exit, residual cut and member to ONNX, calibrate INT8, "
        "probe which other precisions pay here, measure accuracy and latency, fit cascade thresholds and "
        "ensembles, and write ladder.json. A re-run redoes only what changed.",
    )
    add_build_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_build(args)
    except EXPECTED_ERRORS as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    return 0


__all__ = [
    "DEFAULT_MEMBERS",
    "BuildConfig",
    "EngineRecord",
    "add_build_arguments",
    "build_ladder",
    "ladder_table",
    "main",
    "run_build",
]

if __name__ == "__main__":
    sys.exit(main())
