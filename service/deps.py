"""Dependencies shared by the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.errors import NotReady
from service.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def ready_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    if not runtime.ready.is_set():
        raise NotReady("the ladder is still loading", headers={"Retry-After": "1"})
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
ReadyRuntimeDep = Annotated[Runtime, Depends(ready_runtime)]
