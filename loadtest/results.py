"""What a sweep is made of and produces: its configuration, its policies, cells, oracle rows, the sample's luck and
capacities.

Shared by the sweep that runs them (loadtest/sweep.py) and the report that renders them (loadtest/report.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engines.manifest import Ladder
from loadtest.summary import Record

# front: every option the server serves (rungs, ensembles and cascades off no one's shadow), each as `fixed`
POLICY_NAMES = ("auto", "static", "cascade", "front", "baseline")
CAPACITY_ATTAINMENT = 0.99
EXPAND_STEPS, BISECTIONS = 6, 3  # the capacity search's bound: at most 9 short runs per policy


@dataclass(frozen=True)
class PolicySpec:
    """One column of the sweep: what the load generator sends, and to which server."""

    label: str  # auto, static, cascade, fixed:<option>, fixed-fast, fixed-best, an OWN_SERVERS name, baseline
    policy: str  # the request's `policy` field (the baseline ignores it)
    rung: str | None = None
    server: str = "anytime"  # anytime; an OWN_SERVERS name: an Anytime server of its own (loadtest/sweep.py); baseline

    @property
    def baseline(self) -> bool:
        return self.server == "baseline"

    def __str__(self) -> str:
        return f"{self.label} ({self.rung})" if self.rung else self.label


@dataclass
class SweepConfig:
    ladder: Path
    out: Path
    deadlines_ms: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0, 10.0, 20.0)
    rates: tuple[float, ...] = ()  # req/s; none: `load` percent of the measured capacity
    load: tuple[float, ...] = (25.0, 50.0, 75.0, 100.0)
    policies: tuple[str, ...] = POLICY_NAMES
    repeats: int = 3  # every cell is run this many times (seeds seed..seed+repeats-1): the noise
    requests: int = 600  # per cell (and per capacity trial) ...
    duration_s: float = 2.0  # ... or this long, whichever comes first
    warmup_s: float = 1.0  # before each cell, its own load for this long, not scored (0: none)
    on_infeasible: str = "reject"
    timeout_s: float = 10.0
    seed: int = 0
    capacity: bool = False
    capacity_deadline_ms: float = 10.0
    capacity_start: float = 25.0
    steadiness_s: float = 3.0  # the machine-steadiness probe before and after the cells (0: none)
    progress: bool = True

    def plain(self) -> dict[str, Any]:
        """The settings as JSON values (paths as strings), for sweep.json and the journal."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass
class Cell:
    spec: PolicySpec
    rate: float
    deadline_ms: float
    records: list[Record]
    metrics: dict[str, Any]
    repeat: int = 0


@dataclass
class OracleRow:
    """The union bound at one deadline: an image counts if any served plan that fits the deadline is right."""

    deadline_ms: float
    images: int
    fitting: list[str]  # served plans (a cascade at a depth) whose measured p99 at batch 1 fits the deadline
    oracle: float  # share of images at least one fitting plan classifies correctly
    best_rung: str | None  # the most accurate fitting plan by val accuracy ...
    best_rung_accuracy: float  # ... and its accuracy on the same images


@dataclass
class SampleRow:
    """How the images a sweep sends favour one served rung or ensemble: its accuracy on them against the split's."""

    plan: str
    images: int
    sample_accuracy: float  # on the images the repeats draw from (offline)
    test_accuracy: float  # on the whole test split, from the build


@dataclass
class Capacity:
    label: str
    deadline_ms: float
    rate: float | None  # highest rate that passed
    fails_at: float | None  # lowest rate that failed above it
    trials: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SweepResult:
    config: SweepConfig
    ladder: Ladder
    specs: list[PolicySpec]
    machine: dict[str, Any]
    started: str
    wall_s: float
    cells: list[Cell]
    oracle: list[OracleRow]
    capacity: list[Capacity]
    load_capacity: Capacity | None = None  # auto's, when the rates are percentages of it
    sample: list[SampleRow] = field(default_factory=list)
    resumed_cells: int = 0  # cells an earlier, stopped run of the same sweep finished (loadtest/journal.py)
