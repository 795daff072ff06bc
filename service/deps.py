"""Dependencies shared by the routes (async: a plain `def` dependency costs a thread-pool round trip)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
