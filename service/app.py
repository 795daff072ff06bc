"""Builds the FastAPI app: settings -> runtime (loaded in the background) -> routes, errors, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from service.config import Settings
from service.errors import ApiError, PayloadTooLarge, TooManyConnections, install_error_handlers
from service.metrics import Metrics
from service.routes import classify, health, ladder
from service.routes.docs import openapi
from service.runtime import Runtime

log = logging.getLogger("anytime")


class StampAndLimit:
    """ASGI middleware: stamps arrival, refuses over-limit connections and oversized bodies before reading.

    Arrival is when the HTTP parser began the request (service/server.py stamps it), or app entry under a
    server that does not; from there to app entry is the event loop's backlog. Bodies without a
    Content-Length (chunked) are held to the size limit while they are read (service/requests.py).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["entered"] = now = time.monotonic()
        state["arrival"] = state.get("received", now)
        if "loop_lag" in state:  # service/server.py's LoopLag: how long this one waited for the loop
            state["loop_lag"].entered(state["arrival"], now)
            state["metrics"].loop_lag.observe((now - state["arrival"]) * 1e3)
        if "over_connection_limit" in state:  # set by service/server.py's protocol
            open_now = state["over_connection_limit"]
            error: ApiError = TooManyConnections(
                f"{open_now} connections are open, over the limit; retry later",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            await send_error(send, error)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    error = PayloadTooLarge(f"body of {int(value)} bytes is over the limit of {self.limit}")
                    await send_error(send, error)
                    return
                break
        await self.app(scope, receive, send)


async def send_error(send: Send, error: ApiError) -> None:
    """An error answer straight to ASGI, for code that runs outside FastAPI's routes."""
    body = orjson.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
    app.router.routes.extend(classify.routes)  # plain ASGI routes, matched first (see routes/classify.py)
    for module in (health, ladder):
        app.include_router(module.router)
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    app.add_middleware(StampAndLimit, max_body_bytes=settings.max_body_bytes)
    return app
