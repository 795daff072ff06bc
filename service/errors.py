"""The service's named errors; each becomes an HTTP answer with a JSON body {code, message}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("anytime")


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


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


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


class BodyTimeout(ApiError):
    status, code = 408, "body_timeout"


class ShuttingDown(ApiError):
    status, code = 503, "shutting_down"


class OutOfService(ApiError):
    status, code = 503, "out_of_service"


class Overloaded(ApiError):
    status, code = 503, "overloaded"


class TooManyConnections(ApiError):
    status, code = 503, "too_many_connections"


class InternalError(ApiError):
    """A real fault inside the server; its traceback is logged where it happened."""

    status, code = 500, "internal_error"


class ClientGone(Exception):
    """The client disconnected: a normal event, answered with nothing and counted, never logged as an error."""


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as JSON {code, message}; unexpected ones are logged and answered with a bare 500."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse(
            {"code": "invalid_request", "message": f"{where}: {first['msg']}" if where else first["msg"]},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return JSONResponse(
            {"code": code, "message": str(e.detail)}, status_code=e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse({"code": "internal_error", "message": "internal error"}, status_code=500)
