"""What a sweep is made of and produces: its configuration, its policies, cells, oracle rows and capacities.

Shared by the sweep that runs them (loadtest/sweep.py) and the report that renders them (loadtest/report.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.manifest import Ladder
from loadtest.summary import Record

POLICY_NAMES = ("cascade", "static", "fixed-fast", "fixed-best", "baseline")
CAPACITY_ATTAINMENT = 0.99
EXPAND_STEPS, BISECTIONS = 6, 3  # the capacity search's bound: at most 9 short runs per policy


@dataclass(frozen=True)
class PolicySpec:
    """One column of the sweep: what the load generator sends, and to which server."""

    label: str  # cascade, static, fixed-fast, fixed-best, baseline
    policy: str  # the request's `policy` field (the baseline ignores it)
    rung: str | None = None
    baseline: bool = False

    def __str__(self) -> str:
        return f"{self.label} ({self.rung})" if self.rung else self.label


@dataclass
class SweepConfig:
    ladder: Path
    out: Path
    deadlines_ms: tuple[float, ...] = (3.0, 5.0, 10.0, 20.0)
    rates: tuple[float, ...] = (50.0, 200.0)
    policies: tuple[str, ...] = POLICY_NAMES
    requests: int = 200  # per cell (and per capacity trial) ...
    duration_s: float = 5.0  # ... or this long, whichever comes first
    on_infeasible: str = "reject"
    timeout_s: float = 10.0
    seed: int = 0
    capacity: bool = False
    capacity_deadline_ms: float = 10.0
    capacity_start: float = 25.0
    progress: bool = True


@dataclass
class Cell:
    spec: PolicySpec
    rate: float
    deadline_ms: float
    records: list[Record]
    metrics: dict[str, Any]


@dataclass
class OracleRow:
    deadline_ms: float
    images: int
    fitting: list[str]  # non-dominated rungs whose measured p99 at batch 1 fits the deadline
    oracle: float  # share of images that at least one fitting rung classifies correctly
    best_rung: str | None  # the most accurate fitting rung by val accuracy ...
    best_rung_accuracy: float  # ... and its accuracy on the same images


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
