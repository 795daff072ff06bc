"""The service's named errors; each becomes an HTTP answer with a JSON body {code, message}."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message, self.headers, self.extra = message, headers or {}, extra

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.extra}


class BadImage(ApiError):
    status, code = 400, "bad_image"


class UnsupportedMediaType(ApiError):
    status, code = 415, "unsupported_media_type"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class InvalidRequest(ApiError):
    status, code = 422, "invalid_request"


class UnknownRung(ApiError):
    status, code = 404, "unknown_rung"


class QueueFull(ApiError):
    status, code = 429, "queue_full"


class DeadlineInfeasible(ApiError):
    status, code = 503, "deadline_infeasible"


class NotReady(ApiError):
    status, code = 503, "not_ready"


class DeadlineExpired(ApiError):
    status, code = 504, "deadline_expired"
