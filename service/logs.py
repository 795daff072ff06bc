"""Logging: each request's id (taken from X-Request-ID or made) on every line it causes; text or JSON lines.

The id is set in a context variable by the ASGI middleware (service/app.py) for the request's task, so any
log line written while serving it carries it. The scheduler's worker thread names job ids itself.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")  # what a client may pass as X-Request-ID
_ids = itertools.count()
_PREFIX = uuid.uuid4().hex[:8]  # one per process: ids stay unique across restarts and replicas


def new_request_id() -> str:
    return f"{_PREFIX}{next(_ids):08x}"


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-ID when it is a sane token (1-128 of A-Z a-z 0-9 . _ : / + = -), else a new id."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            if _VALID_ID.fullmatch(value):
                return value.decode()
            break
    return new_request_id()


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id`: the one being served, or '-' outside a request."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, request_id, message, and exc_info if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        for key in ("method", "path", "status", "duration_ms"):  # the access log's fields
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def log_config(fmt: LogFormat, level: str = "INFO") -> dict[str, Any]:
    """A logging.config.dictConfig for the service and uvicorn: one stderr handler, the request-id filter."""
    formatter: dict[str, Any] = {"()": JsonFormatter} if fmt == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "filters": ["request_id"],
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["default"], "level": level},
        "loggers": {
            name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
