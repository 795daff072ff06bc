"""OpenAPI documentation of the classify routes: every body form, the query options, every error's schema.

The routes are plain ASGI apps that read their own bodies (to refuse work before reading it), so FastAPI
cannot infer them: `openapi()` adds them to what FastAPI generates for the other routes.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from engines.manifest import Ladder
from service.planner import OnInfeasible, Policy
from service.schemas import (
    BatchRequest,
    BatchResponse,
    ClassifyOptions,
    ClassifyRequest,
    ClassifyResponse,
    ErrorBody,
)

_REF = "#/components/schemas/{model}"

_ERRORS = {
    401: "unauthorized: an API key is set (ANYTIME_API_KEY) and the request lacks `Authorization: Bearer <key>`",
    400: "bad_image: the image cannot be decoded, or breaks a size limit",
    404: "unknown_rung: policy=fixed names a rung the ladder does not have",
    408: "body_timeout: the body did not arrive within the body timeout",
    413: "payload_too_large: the body is over the size limit (refused before it is read when Content-Length says so)",
    415: "unsupported_media_type: a content type this route does not take",
    422: "invalid_request: an option is missing, malformed or given twice",
    429: "queue_full: the queue is full (with Retry-After)",
    500: "internal_error: a fault inside the server (its traceback is in the server's log)",
    503: "deadline_infeasible (with fastest_ms), not_ready, shutting_down, overloaded, out_of_service or "
    "too_many_connections (with Retry-After); on /healthz worker_dead, on /readyz not_ready or load_failed",
    504: "deadline_expired: the answer would only be ready after the deadline (with late_ms)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses, each with the ErrorBody schema."""
    return {status: {"model": ErrorBody, "description": _ERRORS[status]} for status in statuses}


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to `model` among the components (openapi() puts it there)."""
    return {"$ref": _REF.format(model=model.__name__)}


_ANY_ROUTE = (413, 500, 503)


def _error_doc(status: int) -> dict[str, Any]:
    return {
        "description": _ERRORS[status],
        "headers": _RESPONSE_HEADERS,
        "content": {"application/json": {"schema": schema_ref(ErrorBody)}},
    }


_REQUEST_ID = {
    "name": "X-Request-ID",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "Names the request in logs and answers (1-128 of A-Z a-z 0-9 . _ : / + = -); else one is made.",
}
_RESPONSE_HEADERS = {"X-Request-ID": {"description": "the request's id", "schema": {"type": "string"}}}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_DEFAULT = {name: field.default for name, field in ClassifyOptions.model_fields.items()}  # stated once: the schema

_OPTIONS = [
    _query(
        "deadline_ms",
        {"type": "number", "minimum": 1, "maximum": 60000},
        "Answer within this many ms of arrival. Required once: here, in X-Deadline-Ms, or in a JSON/form body.",
    ),
    _query(
        "policy", {"type": "string", "enum": [str(p) for p in Policy]}, f"How to plan (default: {_DEFAULT['policy']})."
    ),
    _query("rung", {"type": "string"}, "The rung to run, with policy=fixed."),
    _query(
        "on_infeasible",
        {"type": "string", "enum": [str(o) for o in OnInfeasible]},
        f"reject: 503/504 when the deadline cannot be met; best_effort: answer anyway (default: "
        f"{_DEFAULT['on_infeasible']}).",
    ),
    _query(
        "top_k",
        {"type": "integer", "minimum": 1, "maximum": 100},
        f"How many classes to list (default: {_DEFAULT['top_k']}).",
    ),
    _query("dtype", {"type": "string", "enum": ["uint8", "float32"]}, "application/x-tensor bodies: element type."),
    _query(
        "shape",
        {"type": "string", "example": "28,28"},
        "application/x-tensor bodies: comma-separated shape; uint8 (H,W) or (1,H,W) grey pixels, float32 the "
        "model's (C,H,W) input after preprocessing; the batch route takes a leading N.",
    ),
    {
        "name": "X-Deadline-Ms",
        "in": "header",
        "required": False,
        "schema": {"type": "number", "minimum": 1, "maximum": 60000},
        "description": "The deadline as a header (instead of deadline_ms).",
    },
    _REQUEST_ID,
]
_OPTION_FIELDS = {
    "deadline_ms": {"type": "number"},
    "policy": {"type": "string"},
    "rung": {"type": "string"},
    "on_infeasible": {"type": "string"},
    "top_k": {"type": "integer"},
}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TENSOR = {
    "schema": {
        "type": "string",
        "format": "binary",
        "description": "raw little-endian C-order elements; dtype and shape in the query",
    }
}


def _operation(
    summary: str, request: type[BaseModel], response: type[BaseModel], files: dict[str, Any], binary: bool
) -> dict[str, Any]:
    content: dict[str, Any] = {
        "application/json": {"schema": schema_ref(request)},
        "multipart/form-data": {
            "schema": {"type": "object", "required": ["file"], "properties": {"file": files, **_OPTION_FIELDS}}
        },
        "application/x-tensor": _TENSOR,
    }
    if binary:
        content.update({"image/png": _BINARY, "image/jpeg": _BINARY, "application/octet-stream": _BINARY})
    responses: dict[str, Any] = {
        "200": {
            "description": "The answer",
            "headers": _RESPONSE_HEADERS,
            "content": {"application/json": {"schema": schema_ref(response)}},
        }
    }
    for status in _ERRORS:
        responses[str(status)] = _error_doc(status)
    return {
        "tags": ["classify"],
        "summary": summary,
        "operationId": f"classify{'_batch' if request is BatchRequest else ''}",
        "parameters": _OPTIONS,
        "requestBody": {"required": True, "content": content},
        "responses": responses,
    }


PATHS = {
    "/v1/classify": {
        "post": _operation(
            "Classify one image within deadline_ms of its arrival; says which rung answered and if it was on time",
            ClassifyRequest,
            ClassifyResponse,
            {"type": "string", "format": "binary"},
            binary=True,
        )
    },
    "/v1/classify/batch": {
        "post": _operation(
            "Classify several images under one deadline; each is planned and may be batched with others",
            BatchRequest,
            BatchResponse,
            {"type": "array", "items": {"type": "string", "format": "binary"}},
            binary=False,
        )
    },
}


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the app's other routes, with the classify routes and their models added; with an
    API key set, the bearer scheme on the routes that need it."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        models = components.setdefault("schemas", {})
        for model in (ClassifyRequest, BatchRequest, ClassifyResponse, BatchResponse, ErrorBody, Ladder):
            model_schema = model.model_json_schema(ref_template=_REF)
            models.update(model_schema.pop("$defs", {}))
            models[model.__name__] = model_schema
        schema["paths"] = {**copy.deepcopy(PATHS), **schema["paths"]}
        api_key = app.state.runtime.api_key
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                if "X-Request-ID" not in {p["name"] for p in operation.setdefault("parameters", [])}:
                    operation["parameters"].append(_REQUEST_ID)
                for status in _ANY_ROUTE:  # the middleware's refusals and a real fault can answer any route
                    operation["responses"].setdefault(str(status), _error_doc(status))
                if api_key.protects(path):
                    operation["security"] = [{"bearer": []}]
                else:
                    operation["responses"].pop("401", None)
        if api_key.enabled:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema
