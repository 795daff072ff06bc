"""Builds the FastAPI app: settings -> runtime (loaded in the background) -> routes, errors, metrics."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.errors import ApiError, PayloadTooLarge
from service.metrics import Metrics
from service.routes import classify, health, ladder
from service.runtime import Runtime

log = logging.getLogger("anytime")


class StampAndLimit:
    """ASGI middleware: stamps arrival time first thing, refuses bodies over the limit before reading them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, PayloadTooLarge(f"body of {int(length)} bytes is over the limit of {self.limit}"))
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # chunked bodies with no Content-Length
                    raise PayloadTooLarge(f"body is over the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


async def _send_error(send: Send, error: ApiError) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def create_app(settings: Settings | None = None, load_in_background: bool = True) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    runtime = Runtime(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load_in_background:
            threading.Thread(target=runtime.load, name="anytime-load", daemon=True).start()
        else:
            runtime.load()
        yield
        runtime.close()

    app = FastAPI(
        title="Anytime",
        version="0.1.0",
        lifespan=lifespan,
        description="Image classification that answers within each request's own deadline.",
    )
    app.state.settings, app.state.runtime, app.state.metrics = settings, runtime, metrics

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

    for module in (classify, health, ladder):
        app.include_router(module.router)
    app.add_middleware(StampAndLimit, max_body_bytes=settings.max_body_bytes)
    return app
