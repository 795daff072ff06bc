"""The sweep's journal: what a sweep keeps as it goes, so that one stopped part way (Ctrl-C, a kill, a lost
shell) loses only the cell it was running, and `anytime sweep --resume` runs only the cells still missing.

A full sweep of the default ladder takes one to two hours on a 2-vCPU machine (72 and 107 minutes, 2026-11-27 and
-28; one stopped unfinished after 94 had written nothing: before the journal, a sweep wrote only after its last
cell). In `--out` it keeps `progress.json` (the settings, the ladder's
digest, the rates and, once measured, the keep-up capacity behind them; the start time and the time spent so far)
and one `records/<cell>.jsonl` per finished cell, each written to a temporary file and renamed, so a file that
exists is whole. A resumed sweep reads the finished cells back (their figures are recomputed from the records, as
they were computed when they ran) and must have the same settings and the same ladder.json; anything else is
refused with the settings that differ. Every cell is warmed with its own load before it is scored (sweep.py), so a
cell run after a resume starts as warm as it would have in one go.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.results import Capacity, SweepConfig
from loadtest.summary import Record, read_records, write_records

JOURNAL = "progress.json"
# Where the report goes, whether bars are drawn and how long the machine is probed: not part of what a cell measures.
NOT_SETTINGS = ("out", "progress", "steadiness_s")


class ResumeError(ValueError):
    """`--resume` on a folder holding no sweep, or a sweep of other settings or another ladder."""


def settings(config: SweepConfig) -> dict[str, Any]:
    """What a resumed sweep must share with the one it continues: every measuring setting and the ladder's bytes."""
    plain = {k: v for k, v in config.plain().items() if k not in NOT_SETTINGS}
    plain["ladder_sha256"] = hashlib.sha256((Path(config.ladder) / "ladder.json").read_bytes()).hexdigest()
    return json.loads(json.dumps(plain))  # tuples as lists, as they come back from the file


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Journal:
    def __init__(self, config: SweepConfig, resume: bool = False) -> None:
        self.out = Path(config.out)
        self.path, self.records = self.out / JOURNAL, self.out / "records"
        wanted = settings(config)
        if resume:
            if not self.path.is_file():
                raise ResumeError(f"nothing to resume in {self.out}: no {JOURNAL} (a sweep writes it as it starts)")
            self.state: dict[str, Any] = json.loads(self.path.read_text())
            had = self.state["settings"]
            differ = sorted(k for k in wanted.keys() | had.keys() if wanted.get(k) != had.get(k))
            if differ:
                raise ResumeError(
                    f"the sweep in {self.out} was run with other settings ({', '.join(differ)} differ): resume "
                    "it with the options it started with, or leave out --resume to start over"
                )
        else:
            self.records.mkdir(parents=True, exist_ok=True)  # and --out
            for old in self.records.glob("*.jsonl"):  # an earlier sweep's cells: never mixed into this one's
                old.unlink()
            started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            self.state = {"settings": wanted, "started": started, "wall_s": 0.0, "rates": None}
            self.state |= {"load_capacity": None, "capacity": None, "complete": False}
            self._save()
        self.records.mkdir(exist_ok=True)  # a resumed sweep stopped before its first cell has none
        self.wall_before = float(self.state["wall_s"])  # spent by the runs before this one

    def _save(self) -> None:
        _write_atomic(self.path, json.dumps(self.state, indent=2))

    @property
    def started(self) -> str:
        return str(self.state["started"])

    def rates(self) -> tuple[float, ...] | None:
        return tuple(self.state["rates"]) if self.state["rates"] is not None else None

    def load_capacity(self) -> Capacity | None:
        kept = self.state["load_capacity"]
        return Capacity(**kept) if kept else None

    def capacity(self) -> list[Capacity] | None:
        kept = self.state["capacity"]
        return [Capacity(**c) for c in kept] if kept is not None else None

    def set_rates(self, rates: tuple[float, ...], load_capacity: Capacity | None) -> None:
        self.state["rates"] = list(rates)
        self.state["load_capacity"] = asdict(load_capacity) if load_capacity else None
        self._save()

    def finished(self, cell: str) -> list[Record] | None:
        """The records of a cell an earlier run finished, or None."""
        path = self.records / f"{cell}.jsonl"
        return read_records(path) if path.is_file() else None

    def add(self, cell: str, records: list[Record], wall_s: float) -> None:
        """A cell just finished; `wall_s`: this run's time so far."""
        tmp = self.records / f"{cell}.jsonl.tmp"
        write_records(tmp, records)
        os.replace(tmp, self.records / f"{cell}.jsonl")
        self.state["wall_s"] = self.wall_before + wall_s
        self._save()

    def done(self, capacity: list[Capacity], wall_s: float) -> None:
        self.state |= {"capacity": [asdict(c) for c in capacity], "complete": True}
        self.state["wall_s"] = self.wall_before + wall_s
        self._save()
