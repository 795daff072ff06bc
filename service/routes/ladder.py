from __future__ import annotations

from fastapi import APIRouter, Response

from service.deps import RuntimeDep

router = APIRouter(prefix="/v1", tags=["ladder"])


@router.get("/ladder")
async def get_ladder(runtime: RuntimeDep) -> Response:
    """Rungs, ensembles (with members and stacker), stages and cascades with profiles, as the builder wrote them."""
    return Response(runtime.ladder_json, media_type="application/json")
