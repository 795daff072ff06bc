from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from service.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(runtime: RuntimeDep) -> JSONResponse:
    """Alive: the process answers and its scheduler's worker runs (503 once it died: restart the process)."""
    if not runtime.scheduler.alive:
        return JSONResponse({"code": "worker_dead", "message": "the scheduler's worker stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    """200 once every engine of the ladder is loaded and warmed; 503 until then."""
    if runtime.ready.is_set():
        return JSONResponse({"status": "ready", "engines": len(runtime.engines)})
    if runtime.failed:  # the details are in the server's log, not for clients
        return JSONResponse({"code": "load_failed", "message": "the ladder could not be loaded"}, status_code=503)
    return JSONResponse(
        {"code": "not_ready", "message": f"loading: {len(runtime.engines)} of {len(runtime.records)} engines warmed"},
        status_code=503,
        headers={"Retry-After": "1"},
    )


@router.get("/metrics")
async def metrics(runtime: RuntimeDep) -> Response:
    runtime.metrics.depth.set(runtime.scheduler.depth())
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
