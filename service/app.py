"""Builds the FastAPI app: settings -> runtime (loaded in the background) -> routes, errors, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.config import Settings
from service.errors import ApiError, PayloadTooLarge, install_error_handlers
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
            runtime.load_in_background()
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

    install_error_handlers(app)
    for module in (classify, health, ladder):
        app.include_router(module.router)
    app.add_middleware(StampAndLimit, max_body_bytes=settings.max_body_bytes)
    return app
