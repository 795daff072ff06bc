"""Request and response bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from service.planner import OnInfeasible, Policy

MAX_BATCH_IMAGES = 256
BLACK_28X28_PNG = "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAAAAABXZoBIAAAAEElEQVR42mNgGAWjYBQQAwADLAAB1wvpfAAAAABJRU5ErkJggg=="


class ClassifyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deadline_ms: float = Field(
        ..., ge=1, le=60000, allow_inf_nan=False, description="answer within this many ms of arrival"
    )
    policy: Policy = Policy.AUTO
    rung: str | None = Field(None, description="the rung to run, with policy=fixed")
    on_infeasible: OnInfeasible = OnInfeasible.REJECT
    top_k: int = Field(1, ge=1, le=100)

    @field_validator("deadline_ms", "top_k", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        """A number, or its text (query strings and headers are text); pydantic's lax mode would take true as 1."""
        if isinstance(value, bool):
            raise PydanticCustomError("bool_type", "Input should be a number, not true or false")
        return value


class ClassifyRequest(ClassifyOptions):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"image": BLACK_28X28_PNG, "deadline_ms": 50}]},
    )

    image: str | list[Any] = Field(..., description="base64 PNG/JPEG, or a nested array of grey values 0..255")


class BatchRequest(ClassifyOptions):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"images": [BLACK_28X28_PNG, BLACK_28X28_PNG], "deadline_ms": 50}]},
    )

    images: list[str | list[Any]] = Field(..., min_length=1, max_length=MAX_BATCH_IMAGES)


class TopK(BaseModel):
    label: int
    class_name: str
    probability: float


class ClassifyResponse(BaseModel):
    request_id: str = Field(..., description="X-Request-ID if the client sent a sane one, else made here")
    label: int
    class_name: str
    top_k: list[TopK]
    rung: str
    policy: Policy
    exit: int = Field(..., description="the exit that answered; 0 for a combination of models")
    precision: str
    backend: str
    members: list[str] = Field(
        default_factory=list, description="the models combined: an ensemble's members, or the members a cascade ran"
    )
    entropy: float
    stages_run: int
    batch_sizes: list[int]
    latency_ms: float
    queue_ms: float
    deadline_ms: float
    deadline_met: bool
    resized: bool
    ladder_version: str = Field(..., description="the first 12 hex digits of the ladder manifest's sha256")


class BatchResponse(BaseModel):
    results: list[ClassifyResponse]


class ErrorBody(BaseModel):
    """Every error answer: a machine-readable `code`, a human `message`, and sometimes more (e.g. `fastest_ms`)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class HealthBody(BaseModel):
    status: Literal["ok"]


class ReadyBody(BaseModel):
    status: Literal["ready"]
    engines: int = Field(..., description="engines loaded and warmed")
    ladder_version: str = Field(..., description="the first 12 hex digits of the ladder manifest's sha256")
