"""Service settings: `ANYTIME_*` environment variables (or `.env`), validated at start-up."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.logs import LogFormat


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ANYTIME_", env_file=".env", extra="ignore")

    ladder: Path = Field(Path("ladders/default"), description="the ladder directory (its ladder.json) to serve")
    host: str = Field("127.0.0.1", description="bind address (0.0.0.0: every interface)")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    threads: int | None = Field(None, ge=1, le=256, description="threads per engine (default: the ladder's)")
    max_queue: int = Field(256, ge=1, description="queued requests before 429")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="a larger body is refused 413")
    max_batch: int = Field(32, ge=1, le=1024, description="queued items one engine run may take together")
    safety_margin_ms: float = Field(
        0.5,
        ge=0,
        le=1000,
        description="plans must finish this long before the deadline: what the server cannot see (sending the answer, "
        "the client reading it) and the tail of its own path",
    )
    inline_max_ms: float = Field(
        0.15,
        ge=0,
        le=1,
        description="engines whose profiled median is this quick run on the event loop (service/scheduler.py)",
    )
    inline_max_deadline_ms: float = Field(
        5.0,
        ge=0,
        description="a quick engine runs inline for a request with a deadline this tight; for a looser one only while "
        "it is the one request in the app, else on the worker, where it can be batched (service/routes/classify.py)",
    )
    observed_window: int = Field(200, ge=10, description="observed service times kept per engine and batch size")
    include_dominated: bool = Field(
        False, description="also load and plan over options another is as accurate as and no slower than"
    )
    auto_caution: bool = Field(
        True, description="auto inflates its predictions after late answers (service/caution.py); off: bare"
    )
    auto_caution_slack_ms: float = Field(
        0.5,
        ge=0,
        le=1000,
        description="auto's caution counts an answer ready less than this before its deadline as late: what follows "
        "the server's clock (sending, the client reading) can still make it late at the client; 0: only answers "
        "late at the server count",
    )
    auto_utilization: float = Field(
        0.7,
        ge=0,
        le=4,
        description="auto keeps the average engine time of its choices within this share of a core per second "
        "of arrivals (service/load.py); 0: auto ignores the load",
    )
    auto_load_restraint: bool = Field(
        True,
        description="auto divides its load budget by a factor that its late answers and its requests refused for "
        "the queue ahead raise and on-time answers lower (service/load.py); off: the rate's budget alone",
    )
    auto_tie_se: float = Field(
        1.0,
        ge=0,
        le=10,
        description="auto counts val accuracies within this many standard errors (paired, where the ladder records "
        "each val image) of the best reachable as equal and takes the cheapest of them (the one-standard-error "
        "rule); 0: always the most accurate",
    )
    auto_quick_fallback: bool = Field(
        True,
        description="where caution leaves auto no option, or only options less accurate than it, the most accurate of "
        "the quickest first steps (typical time within the quickest one's p99) answers; off: what fits under caution, "
        "else the quickest first step",
    )
    warmup_runs: int = Field(
        5, ge=0, description="warm-up runs of each engine at start-up (batch 1 and 8) before /readyz says ready"
    )
    # The front door (service/server.py): what a slow or greedy client may hold.
    max_connections: int = Field(
        512, ge=1, description="open connections; more are answered 503 too_many_connections and closed"
    )
    keep_alive_s: int = Field(5, ge=1, description="an idle connection is closed after this long")
    body_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a body that takes longer to arrive is answered 408 (504 deadline_expired where the request's "
        "deadline, known from its query string or X-Deadline-Ms, comes first)",
    )
    drain_timeout_s: int = Field(10, ge=1, description="on SIGTERM, in-flight work gets this long to finish")
    shed_after_ms: float = Field(
        2.0,
        gt=0,
        description="while the event loop is this far behind (or 40 % of the tightest deadline among the last 64 "
        "requests admitted, if more), new classify requests are refused 503",
    )
    shed_per_poll: int = Field(
        1, ge=1, description="under sustained overload, classify requests admitted per turn of the event loop"
    )
    shed_min_connections: int = Field(
        8,
        ge=0,
        description="shedding starts only with more than this many requests in flight, and never with this many "
        "connections open or fewer (each carries one request at a time: that many waiting clients cannot overload "
        "the server; idle keep-alive connections alone do not start it)",
    )
    keep_cores_awake: bool = Field(
        False,
        description="spin a lowest-priority process on each core the server may use, so that an idle core does not "
        "sleep and a lone request does not pay for waking it (service/awake.py; the cores then show 100 % busy)",
    )
    access_log: bool = Field(
        False,
        description="one log line per request that reaches the app (refusals the HTTP parser writes itself are "
        "counted in /metrics only); off: it costs more than a fast rung",
    )
    otel: bool = Field(
        False,
        description="FastAPI's native OpenTelemetry tracing, metrics and logs (off: /metrics is the service's "
        "telemetry; when on, every request first asks the global OpenTelemetry providers whether they are set)",
    )
    log_format: LogFormat = Field("text", description="text lines, or one JSON object a line")
    # Security (service/auth.py): without a key every route is open, as on a trusted network.
    api_key: SecretStr | None = Field(None, description="if set, /v1 routes need `Authorization: Bearer <key>`")
    api_key_metrics: bool = Field(False, description="with api_key set: /metrics needs the key too")

    @field_validator("ladder")
    @classmethod
    def _ladder_exists(cls, v: Path) -> Path:
        if not (v / "ladder.json").is_file():
            raise ValueError(f"no ladder.json in {v}: build one with `anytime build --out {v}`")
        return v


def reference() -> str:
    """Every setting as a Markdown table row: variable, default, meaning (README.md, "Settings", holds this table;
    tests/test_docs.py keeps the two the same)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        rows.append(f"| `ANYTIME_{name.upper()}` | `{shown}` | {field.description or ''} |")
    return "\n".join(rows)
