from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from service.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Alive: the process answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    """200 once every engine of the ladder is loaded and warmed; 503 until then."""
    if runtime.ready.is_set():
        return JSONResponse({"status": "ready", "engines": len(runtime.engines)})
    if runtime.failed:
        return JSONResponse({"code": "load_failed", "message": runtime.failed}, status_code=503)
    return JSONResponse(
        {"code": "not_ready", "message": f"loading: {len(runtime.engines)} of {len(runtime.records)} engines warmed"},
        status_code=503,
        headers={"Retry-After": "1"},
    )


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    runtime.metrics.depth.set(runtime.scheduler.depth())
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
