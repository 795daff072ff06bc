"""Service settings: `ANYTIME_*` environment variables (or `.env`), validated at start-up."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ANYTIME_", env_file=".env", extra="ignore")

    ladder: Path = Path("ladders/default")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    threads: int = Field(2, ge=1, le=256, description="threads per engine")
    max_queue: int = Field(256, ge=1, description="queued requests before 429")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_batch: int = Field(32, ge=1, le=1024)
    batch_window_ms: float = Field(0.5, ge=0, le=100, description="wait this long for batch-mates when slack allows")
    safety_margin_ms: float = Field(0.5, ge=0, le=1000)
    observed_window: int = Field(200, ge=10, description="observed service times kept per engine and batch size")
    include_dominated: bool = False
    warmup_runs: int = Field(5, ge=0)

    @field_validator("ladder")
    @classmethod
    def _ladder_exists(cls, v: Path) -> Path:
        if not (v / "ladder.json").is_file():
            raise ValueError(f"no ladder.json in {v}: build one with `anytime build --out {v}`")
        return v
