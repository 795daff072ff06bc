"""Health, readiness and metrics: open to all (the API key, when set, guards /metrics only if asked)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from service.deps import RuntimeDep
from service.routes.docs import error_responses
from service.schemas import HealthBody, ReadyBody

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthBody, responses=error_responses(503))
async def healthz(runtime: RuntimeDep) -> JSONResponse:
    """Alive: the process answers and its scheduler's worker runs (503 worker_dead once it died: restart it)."""
    if not runtime.scheduler.alive:
        return JSONResponse({"code": "worker_dead", "message": "the scheduler's worker stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", response_model=ReadyBody, responses=error_responses(503))
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    """200 once every served engine of the ladder is loaded and warmed; 503 not_ready or load_failed until then."""
    if runtime.ready.is_set():
        return JSONResponse(
            {"status": "ready", "engines": len(runtime.engines), "ladder_version": runtime.ladder_version}
        )
    if runtime.failed:  # the details are in the server's log, not for clients
        return JSONResponse({"code": "load_failed", "message": "the ladder could not be loaded"}, status_code=503)
    return JSONResponse(
        {"code": "not_ready", "message": f"loading: {len(runtime.engines)} of {len(runtime.served)} engines warmed"},
        status_code=503,
        headers={"Retry-After": "1"},
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format 0.0.4", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
async def metrics(runtime: RuntimeDep) -> Response:
    """Prometheus metrics: requests by policy, rung and code; latency, queue, phases, batches, loop lag."""
    runtime.metrics.depth.set(runtime.scheduler.depth())
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
