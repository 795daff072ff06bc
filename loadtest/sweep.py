"""The sweep: deadlines x policies x Poisson rates against a server it starts itself, repeated to show the
noise, with two hindsight references and an MLPerf-Server-style capacity search; writes a report folder
(report.md, PNG plots, JSON, records).

Policies: `auto` (the server's default), `static`, `cascade`, every served option as `fixed` (`front`), and
the plain baseline server. The references, computed afterwards: the best fixed plan in hindsight (per cell,
the one fixed column, `fixed:NAME`, `fixed-fast` or `fixed-best`, that scored best there) and the union bound
(offline, on the images of every repeat: an image counts if any served plan whose measured batch-1 p99 fits the
deadline classifies it correctly; an upper bound no policy reaches).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from engines.ensemble import soft_vote
from engines.factory import open_record
from engines.manifest import Ensemble, Ladder, MemberCascade, Rung, load_ladder
from engines.steps import measure as profile
from loadtest.baseline import baseline_rung, running_baseline
from loadtest.client import LoadConfig, run_load
from loadtest.harness import running_server
from loadtest.journal import Journal
from loadtest.report import write_report
from loadtest.results import (
    BISECTIONS,
    CAPACITY_ATTAINMENT,
    EXPAND_STEPS,
    POLICY_NAMES,
    Capacity,
    Cell,
    OracleRow,
    PolicySpec,
    SampleRow,
    SweepConfig,
    SweepResult,
)
from loadtest.schedule import DeadlineMix, image_order
from loadtest.steadiness import measure as measure_steadiness
from loadtest.summary import METHOD, Record, summarize
from models.data import PreprocessSpec, Split

KEEP_UP_DEADLINE_MS, KEEP_UP_SHARE = 100.0, 0.95
WARMUP_SEED = 1_000_003  # the warm-ups' arrivals and images: other than any repeat's
# Columns served by an Anytime server of their own, started with these settings: auto, and auto with a feedback
# off or changed. A server's online estimates (engine times, the arrival rate, caution, its own path's time) are
# set by the cells it serves in turn; on the server of static, cascade and the fixed columns, auto inherited theirs.
# Measured in the sweep of 2026-11-25 (`reports/sweep-slack`, auto on that shared server): at 10 ms, the most
# accurate cascade gave 87 % of auto's first 150 answers of a cell (47 % in the worst of 12) and 100 % of its last
# 150, while the same auto on a server of its own gave it 100 % from the first answers (2026-11-26).
OWN_SERVERS = {
    "auto": {},
    "auto-bare": {"ANYTIME_AUTO_CAUTION": "false"},  # service/caution.py off
    "auto-unloaded": {"ANYTIME_AUTO_UTILIZATION": "0"},  # service/load.py off
    "auto-rate-budget": {"ANYTIME_AUTO_LOAD_RESTRAINT": "false"},  # the load budget without its feedback
    "auto-most-accurate": {"ANYTIME_AUTO_TIE_SE": "0"},  # no ties: always the most accurate option that fits
    "auto-server-late": {"ANYTIME_AUTO_CAUTION_SLACK_MS": "0"},  # caution counts only answers late at the server
    "auto-fastest-fallback": {"ANYTIME_AUTO_QUICK_FALLBACK": "false"},  # nothing fits under caution: the quickest
}  # capacity: >= 95 % answered 200 within 100 ms at the client


def _candidates(ladder: Ladder) -> list[Rung | Ensemble]:
    return [r for r in [*ladder.rungs, *ladder.ensembles] if not r.dominated]


def served_plans(ladder: Ladder) -> list[str]:
    """Every option the server serves by default: rungs and ensembles no other dominates, and the cascades."""
    members = [c.name for c in ladder.member_cascades if not c.dominated]
    return [r.name for r in _candidates(ladder)] + [c.name for c in ladder.cascades] + members


def _plan_names(ladder: Ladder) -> set[str]:
    """Every option a `fixed` request may name: rungs, ensembles, stage and member cascades."""
    groups = (ladder.rungs, ladder.ensembles, ladder.cascades, ladder.member_cascades)
    return {option.name for group in groups for option in group}


def policy_specs(ladder: Ladder, names: tuple[str, ...]) -> list[PolicySpec]:
    """auto, static, cascade; front: a fixed column per served option; fixed-fast: the non-dominated rung with
    the lowest p99 at batch 1; fixed-best: the highest val accuracy; fixed:NAME: the ladder's option NAME (a rung,
    ensemble or cascade; a dominated rung is loaded when first asked for); auto-bare, auto-unloaded,
    auto-rate-budget, auto-most-accurate, auto-server-late and auto-fastest-fallback: auto without caution, without
    the load budget, with the load budget but without its restraint, without ties, with caution counting only
    answers late at the server, or with the quickest first step where caution leaves no option, for a side-by-side
    comparison (auto and each of these run on an Anytime server of its own: OWN_SERVERS); auto-shared: auto on the
    server the fixed columns share; baseline: loadtest/baseline.py. An unknown name raises ValueError.
    """
    specs = []
    for name in names:
        if name in OWN_SERVERS:
            specs.append(PolicySpec(name, "auto", server=name))
        elif name in ("cascade", "static"):
            specs.append(PolicySpec(name, name))
        elif name == "auto-shared":  # auto on the server of static, cascade and the fixed columns
            specs.append(PolicySpec(name, "auto"))
        elif name == "front":
            specs += [PolicySpec(f"fixed:{plan}", "fixed", plan) for plan in served_plans(ladder)]
        elif name == "fixed-fast":
            rung = min(_candidates(ladder), key=lambda r: r.profile(1).p99_ms)
            specs.append(PolicySpec(name, "fixed", rung.name))
        elif name == "fixed-best":
            rung = max(_candidates(ladder), key=lambda r: (r.val_accuracy, -r.profile(1).p99_ms))
            specs.append(PolicySpec(name, "fixed", rung.name))
        elif name == "baseline":
            specs.append(PolicySpec(name, "baseline", baseline_rung(ladder.model_dump(mode="json")), server="baseline"))
        elif name.startswith("fixed:"):
            plan = name.removeprefix("fixed:")
            if plan not in _plan_names(ladder):
                raise ValueError(f"{name!r}: the ladder has no option {plan!r}; see GET /v1/ladder or ladder.json")
            specs.append(PolicySpec(name, "fixed", plan))
        else:
            choices = ", ".join(dict.fromkeys((*POLICY_NAMES, "fixed-fast", "fixed-best", *OWN_SERVERS, "fixed:NAME")))
            raise ValueError(f"unknown sweep policy {name!r}; choose from {choices}")
    return specs


def machine_info(ladder: Ladder) -> dict[str, Any]:
    return {**profile.machine_info(), "ladder_built_on": ladder.machine}


# -- the union bound (offline) --------------------------------------------------------------------------------
def plan_answers(
    ladder_dir: Path, ladder: Ladder, split: Split, images: np.ndarray
) -> list[tuple[str, float, float, np.ndarray]]:
    """Offline answers of every served plan on `images`: (plan, batch-1 p99 ms, val accuracy, correct).

    Rungs and ensembles as they are; a member cascade once per depth (its first j members combined, at the
    summed p99 of those members). Stage cascades are left out: their exits are the exit rungs of the same
    network (in the bound through those rungs where they are served).
    """
    spec = PreprocessSpec.from_dict(ladder.preprocess)
    x, y = spec.normalize(split.images[images]), split.labels[images]
    rungs = {r.name: r for r in ladder.rungs}
    logits: dict[str, np.ndarray] = {}

    def run(name: str) -> np.ndarray:
        if name not in logits:
            record = rungs.get(name) or ladder.ensemble(name)
            engine = open_record(ladder_dir, ladder, record, ladder.threads)
            try:
                logits[name] = np.concatenate([engine.infer(x[i : i + 250]) for i in range(0, len(x), 250)])
            finally:
                engine.close()
        return logits[name]

    out = [(r.name, r.profile(1).p99_ms, r.val_accuracy, run(r.name).argmax(1) == y) for r in _candidates(ladder)]
    for cascade in (c for c in ladder.member_cascades if not c.dominated):
        out += _member_depths(cascade, rungs, run, y)
    return out


def _member_depths(
    cascade: MemberCascade, rungs: dict[str, Rung], run: Callable[[str], np.ndarray], y: np.ndarray
) -> list[tuple[str, float, float, np.ndarray]]:
    """A member cascade's combined answer after each depth (soft vote: its stackers are not re-run here)."""
    out, p99 = [], 0.0
    for j, member in enumerate(cascade.members, start=1):
        p99 += rungs[member].profile(1).p99_ms
        answer = soft_vote([run(m) for m in cascade.members[:j]])
        out.append((f"{cascade.name}@{j}", p99, cascade.val_accuracy_by_depth[j - 1], answer.argmax(1) == y))
    return out


def sample_luck(ladder: Ladder, answers: list[tuple[str, float, float, np.ndarray]]) -> list[SampleRow]:
    """Each served rung's and ensemble's accuracy on the sweep's images beside its accuracy on the whole test split
    (the build's). The best fixed plan in hindsight is picked on these images, so a plan they favour gains there
    by about the difference, which a policy that chooses on val accuracy cannot. Member cascades are left out:
    `plan_answers` soft-votes their members, where the server runs their gates and stackers."""
    records = {r.name: r for r in [*ladder.rungs, *ladder.ensembles]}
    return [
        SampleRow(name, len(right), float(right.mean()), records[name].test_accuracy)
        for name, _, _, right in answers
        if name in records
    ]


def oracle_bound(
    answers: list[tuple[str, float, float, np.ndarray]], deadlines_ms: tuple[float, ...]
) -> list[OracleRow]:
    """Per deadline: the share of images some served plan fitting it (batch-1 p99 <= deadline) gets right."""
    rows = []
    n = len(answers[0][3])
    for d in deadlines_ms:
        fitting = [a for a in answers if a[1] <= d]
        hits = np.zeros(n, bool)
        for a in fitting:
            hits |= a[3]
        best = max(fitting, key=lambda a: a[2], default=None)
        rows.append(
            OracleRow(
                d,
                n,
                [a[0] for a in fitting],
                float(hits.mean()),
                best[0] if best else None,
                float(best[3].mean()) if best else 0.0,
            )
        )
    return rows


# -- capacity -------------------------------------------------------------------------------------------------
def find_capacity(
    passes: Callable[[float], bool], start: float, expand_steps: int = EXPAND_STEPS, bisections: int = BISECTIONS
) -> tuple[float | None, float | None]:
    """Highest passing rate by doubling (or halving) from `start` until pass/fail are bracketed, then bisection.

    Returns (highest rate that passed, lowest rate above it that failed); either is None when the bounded
    search did not find one. Assumes passing is monotone in the rate, which short noisy runs only roughly are.
    """
    passed: float | None = None
    failed: float | None = None
    rate = start
    for _ in range(expand_steps):
        if passes(rate):
            passed = rate
            if failed is not None:
                break
            rate *= 2
        else:
            failed = rate
            if passed is not None:
                break
            rate /= 2
    if passed is None or failed is None:
        return passed, failed
    for _ in range(bisections):
        mid = (passed + failed) / 2
        if passes(mid):
            passed = mid
        else:
            failed = mid
    return passed, failed


def capacity_passes(metrics: dict[str, Any], deadline_ms: float) -> bool:
    """MLPerf Server style: p99 server latency within the deadline and at least 99 % of requests on time."""
    p99 = metrics["server_latency_ms"]["p99"]
    return p99 is not None and p99 <= deadline_ms and (metrics["attainment"] or 0.0) >= CAPACITY_ATTAINMENT


class _Runner:
    """Runs one cell's load against the right server and keeps its records.

    Each cell is first warmed: `warmup_s` of the same load (rate, deadline, policy) with another seed's arrivals
    and images, not scored. A server serves its cells in turn and idles while the other columns' cells run (auto's
    own server through every other column), so without it a cell began on a server whose online estimates (engine
    times, the path after planning, the arrival rate: a 1 s average) still described an idle machine, while the
    fixed columns, which share one server, began warm from the column before. Side by side at 2 ms and 800 req/s,
    6 rounds (2026-11-26, one-off script): `auto` 84.7 % effective accuracy on its own server after 12 s idle,
    85.9 % on the fixed columns' warm server, fixed VGG mirror INT8 86.5 %.
    """

    def __init__(self, config: SweepConfig, split: Split, urls: dict[str, str]) -> None:
        self.config, self.split, self.urls = config, split, urls

    def run(
        self, spec: PolicySpec, rate: float, deadline_ms: float, duration_s: float | None = None, repeat: int = 0
    ) -> tuple[list[Record], dict[str, Any]]:
        c = self.config
        load = LoadConfig(
            url=self.urls[spec.server],
            rate=rate,
            requests=c.requests,
            duration_s=duration_s or c.duration_s,
            deadlines=DeadlineMix.single(deadline_ms),
            policy=spec.policy,
            rung=spec.rung if spec.policy == "fixed" else None,
            on_infeasible=c.on_infeasible,
            timeout_s=c.timeout_s,
            seed=c.seed + repeat,
        )
        if c.warmup_s > 0:
            warmup = replace(
                load, requests=int(rate * c.warmup_s) + 1, duration_s=c.warmup_s, seed=WARMUP_SEED + repeat
            )
            run_load(warmup, self.split, progress=False)
        records = run_load(load, self.split, progress=False)
        return records, summarize(records)


def keep_up_capacity(runner: _Runner, spec: PolicySpec, start: float) -> Capacity:
    """The highest rate whose answers keep up: >= 95 % answered 200 within a loose 100 ms at the client."""
    result = Capacity(spec.label, KEEP_UP_DEADLINE_MS, None, None)

    def passes(rate: float) -> bool:
        _, metrics = runner.run(spec, rate, KEEP_UP_DEADLINE_MS)
        ok = (metrics["attainment_client"] or 0.0) >= KEEP_UP_SHARE
        result.trials.append(
            {
                "rate": rate,
                "passed": ok,
                "sent": metrics["sent"],
                "server_p99_ms": metrics["server_latency_ms"]["p99"],
                "attainment": metrics["attainment_client"],
            }
        )
        return ok

    result.rate, result.fails_at = find_capacity(passes, start)
    return result


@contextmanager
def _servers(ladder_dir: Path, servers: set[str]) -> Iterator[dict[str, str]]:
    """The servers the columns need, all started before the first cell; one takes load at a time, the others
    idle (an Anytime server of its own for each OWN_SERVERS column: they then run the same cells, interleaved)."""
    with ExitStack() as stack:
        urls = {"anytime": stack.enter_context(running_server(ladder_dir))} if "anytime" in servers else {}
        for name, env in OWN_SERVERS.items():
            if name in servers:
                urls[name] = stack.enter_context(running_server(ladder_dir, **env))
        if "baseline" in servers:
            urls["baseline"] = stack.enter_context(running_baseline(ladder_dir))
        yield urls


def column_order(specs: list[PolicySpec], seed: int, repeat: int, rate: float, deadline_ms: float) -> list[PolicySpec]:
    """The order the columns of one cell run in: a random permutation, seeded by the sweep's seed, the repeat, the
    rate and the deadline. The machine's speed drifts over seconds to minutes; in a fixed order one column always
    ran first in each cell, right after the last column of the cell before, and a drift that lines up with the
    order favours some columns over others in every repeat. A random order spreads it over all of them (each
    repeat of a cell has its own order), and the same seed gives the same order again."""
    rng = np.random.default_rng([seed, repeat, round(rate * 1000), round(deadline_ms * 1000)])
    return [specs[i] for i in rng.permutation(len(specs))]


def _cell_name(cell: Cell) -> str:
    return f"rate{cell.rate:g}_d{cell.deadline_ms:g}_{cell.spec.label.replace(':', '-')}_r{cell.repeat}"


def run_sweep(config: SweepConfig, split: Split, resume: bool = False) -> SweepResult:
    """The union bound first (offline, before any server runs), then the rates, every cell, the capacities.

    Each finished cell is kept in the journal under config.out at once (loadtest/journal.py); with `resume`, the
    cells an earlier run of the same settings finished are read back instead of run again (ResumeError if the
    folder holds no sweep or one of other settings)."""
    journal = Journal(config, resume)  # first: a resume that cannot be is refused before any work
    t0 = time.perf_counter()
    ladder = load_ladder(config.ladder)
    specs = policy_specs(ladder, config.policies)
    per_repeat = min(config.requests, len(split))  # each repeat sends its own seeded order (_Runner.run)
    images = np.concatenate([image_order(len(split), config.seed + k)[:per_repeat] for k in range(config.repeats)])
    answers = plan_answers(config.ladder, ladder, split, images)
    oracle, sample = oracle_bound(answers, config.deadlines_ms), sample_luck(ladder, answers)
    capacity: list[Capacity] = []
    load_capacity = journal.load_capacity()
    rates = config.rates or journal.rates()
    # Without rates, auto's keep-up capacity on its own server sets them; a server no column needs is not started.
    auto = next((s for s in specs if s.label == "auto"), PolicySpec("auto", "auto", server="auto"))
    steadiness = {"before": measure_steadiness(config.steadiness_s).plain()} if config.steadiness_s > 0 else {}
    with _servers(config.ladder, {s.server for s in specs} | (set() if rates else {auto.server})) as urls:
        runner = _Runner(config, split, urls)
        if not rates:
            load_capacity = keep_up_capacity(runner, auto, config.capacity_start)
            if load_capacity.rate is None:
                raise RuntimeError(f"no rate kept up, down to {config.capacity_start / 2**EXPAND_STEPS:g} req/s")
            rates = tuple(round(load_capacity.rate * p / 100, 1) for p in config.load)
        journal.set_rates(rates, load_capacity)
        grid = [
            Cell(s, r, d, [], {}, k)
            for k in range(config.repeats)
            for r in rates
            for d in config.deadlines_ms
            for s in column_order(specs, config.seed, k, r, d)
        ]
        todo = []
        for cell in grid:
            kept = journal.finished(_cell_name(cell))
            if kept is None:
                todo.append(cell)
            else:
                cell.records, cell.metrics = kept, summarize(kept)
        resumed = len(grid) - len(todo)  # the bar counts them as done
        for cell in tqdm(todo, "sweep", len(grid), unit="cell", disable=not config.progress, initial=resumed):
            cell.records, cell.metrics = runner.run(cell.spec, cell.rate, cell.deadline_ms, repeat=cell.repeat)
            journal.add(_cell_name(cell), cell.records, time.perf_counter() - t0)
        if config.capacity:
            capacity = journal.capacity() or [
                _search_capacity(runner, spec, config)
                for spec in tqdm(specs, desc="capacity", unit="policy", disable=not config.progress)
            ]
    if steadiness:  # the servers have stopped: the probe has the machine to itself again
        steadiness["after"] = measure_steadiness(config.steadiness_s).plain()
    journal.done(capacity, time.perf_counter() - t0)
    config.rates = rates
    return SweepResult(
        config,
        ladder,
        specs,
        {**machine_info(ladder), **({"steadiness": steadiness} if steadiness else {})},
        journal.started,
        journal.wall_before + time.perf_counter() - t0,
        grid,
        oracle,
        capacity,
        load_capacity,
        sample,
        resumed,
    )


def _search_capacity(runner: _Runner, spec: PolicySpec, config: SweepConfig) -> Capacity:
    result = Capacity(spec.label, config.capacity_deadline_ms, None, None)

    def passes(rate: float) -> bool:
        # Every trial sends the full request count (a p99 needs samples): long enough for almost every
        # Poisson schedule of `requests` arrivals, however low the rate.
        duration = max(config.duration_s, 2 * config.requests / rate)
        _, metrics = runner.run(spec, rate, config.capacity_deadline_ms, duration)
        ok = capacity_passes(metrics, config.capacity_deadline_ms)
        result.trials.append(
            {
                "rate": rate,
                "passed": ok,
                "sent": metrics["sent"],
                "server_p99_ms": metrics["server_latency_ms"]["p99"],
                "attainment": metrics["attainment"],
                "send_lag_p99_ms": metrics["send_lag_ms"]["p99"],
            }
        )
        return ok

    result.rate, result.fails_at = find_capacity(passes, config.capacity_start)
    return result


def save_sweep(result: SweepResult) -> Path:
    """sweep.json, report.md and the plots under config.out (beside the journal's per-cell records); returns
    report.md's path."""
    out = result.config.out  # the cells' records are already there: the journal wrote each as it finished
    data = {
        "config": result.config.plain(),
        "machine": result.machine,
        "started": result.started,
        "wall_s": result.wall_s,
        "resumed_cells": result.resumed_cells,
        "policies": [asdict(s) for s in result.specs],
        "oracle": [asdict(o) for o in result.oracle],
        "sample": [asdict(r) for r in result.sample],
        "capacity": [asdict(c) for c in result.capacity],
        "load_capacity": asdict(result.load_capacity) if result.load_capacity else None,
        "method": METHOD,
        "cells": [
            {
                "policy": c.spec.label,
                "rung": c.spec.rung,
                "rate": c.rate,
                "deadline_ms": c.deadline_ms,
                "repeat": c.repeat,
                **{k: v for k, v in c.metrics.items() if k != "method"},
            }
            for c in result.cells
        ],
    }
    (out / "sweep.json").write_text(json.dumps(data, indent=2))
    return write_report(result)
