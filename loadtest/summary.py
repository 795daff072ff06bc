"""Per-request records of a load run and the summary computed from them (a pure function).

Every rate is over requests *sent*: a late answer, a rejection or a failure counts against attainment and
effective accuracy, so an overloaded server cannot look good by refusing work.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
# Refused before any work was done; every other non-200 outcome is an error.
REJECTION_CODES = frozenset({"deadline_infeasible", "queue_full", "not_ready", "shutting_down", "too_many_connections"})

METHOD = (
    "throughput: 200 answers per second from the first send to the last answer; attainment: 200 answers "
    "with deadline_met / requests sent; effective accuracy: correct 200 answers with deadline_met / requests "
    "sent (late, rejected and failed count as wrong); the _client variants take on time as the client saw "
    "it (send to full response within the deadline); accuracy of the answered: correct / 200 answers; "
    "client latency: send to full response body in the load generator, over every request (a failure counts "
    "at the time it failed); server latency: the server's own arrival-to-answer latency_ms, over every "
    "response that carries one (error bodies do not); percentiles: numpy linear interpolation; exit and rung "
    "shares: of the 200 answers."
)


@dataclass
class Record:
    """One request: what was sent, when, and what came back (status 0: no HTTP answer)."""

    i: int
    image: int  # index into the test split
    label: int  # its true class
    deadline_ms: float
    send_s: float  # seconds from the start of the run to the send
    lag_ms: float  # how late the send left against its schedule (open loop), 0 for single-stream
    client_ms: float
    status: int
    code: str  # "ok" for 200; the error body's code; "client_timeout" / "transport_error" without an answer
    server_ms: float | None = None
    queue_ms: float | None = None
    rung: str | None = None
    exit: int | None = None
    deadline_met: bool = False
    correct: bool = False
    new_connection: bool = False  # the request waited for a connection to be opened and accepted

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.code == "ok"

    @property
    def on_time(self) -> bool:
        return self.answered and self.deadline_met

    @property
    def on_time_at_client(self) -> bool:
        """Answered 200 within the deadline as the client measured it (send to full response)."""
        return self.answered and self.client_ms <= self.deadline_ms


def write_records(path: Path, records: Iterable[Record]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")


def read_records(path: Path) -> list[Record]:
    return [Record(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True)}


def _shares(values: Iterable[object], total: int) -> dict[str, float]:
    counts = Counter(str(v) for v in values)
    return {k: n / total for k, n in sorted(counts.items())} if total else {}


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """The run's figures; see METHOD for how each is computed."""
    sent = len(records)
    answered = [r for r in records if r.answered]
    on_time = sum(r.on_time for r in records)
    failed = Counter(r.code for r in records if not r.answered)
    span = max((r.send_s + r.client_ms / 1e3 for r in records), default=0.0) - min(
        (r.send_s for r in records), default=0.0
    )
    send_span = max((r.send_s for r in records), default=0.0) - min((r.send_s for r in records), default=0.0)

    def rate(n: int) -> float | None:
        return n / sent if sent else None

    return {
        "sent": sent,
        "answered": len(answered),
        "on_time": on_time,
        "span_s": span,
        "offered_rate": (sent - 1) / send_span if send_span > 0 else None,
        "throughput": len(answered) / span if span > 0 else None,
        "attainment": rate(on_time),
        "effective_accuracy": rate(sum(r.on_time and r.correct for r in records)),
        "attainment_client": rate(sum(r.on_time_at_client for r in records)),
        "effective_accuracy_client": rate(sum(r.on_time_at_client and r.correct for r in records)),
        "answered_accuracy": sum(r.correct for r in answered) / len(answered) if answered else None,
        "late_rate": rate(sum(r.answered and not r.deadline_met for r in records)),
        "rejection_rate": rate(sum(n for code, n in failed.items() if code in REJECTION_CODES)),
        "error_rate": rate(sum(n for code, n in failed.items() if code not in REJECTION_CODES)),
        "rates_by_code": {code: n / sent for code, n in sorted(failed.items())},
        "client_latency_ms": _percentiles([r.client_ms for r in records]),
        "server_latency_ms": _percentiles([r.server_ms for r in records if r.server_ms is not None]),
        "server_latency_n": sum(r.server_ms is not None for r in records),
        "send_lag_ms": _percentiles([r.lag_ms for r in records]),
        "exit_shares": _shares((r.exit for r in answered), len(answered)),
        "rung_shares": _shares((r.rung for r in answered), len(answered)),
        "method": METHOD,
    }
