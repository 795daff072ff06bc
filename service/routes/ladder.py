from __future__ import annotations

from fastapi import APIRouter, Response

from engines.manifest import Ladder
from service.deps import RuntimeDep
from service.routes.docs import error_responses, schema_ref

router = APIRouter(prefix="/v1", tags=["ladder"])


@router.get(
    "/ladder",
    response_class=Response,
    responses={
        200: {
            "description": "The ladder manifest",
            "content": {"application/json": {"schema": schema_ref(Ladder)}},
        },
        **error_responses(401),
    },
)
async def get_ladder(runtime: RuntimeDep) -> Response:
    """Rungs, ensembles (with members and stacker), stages and cascades with profiles, as the builder wrote them."""
    return Response(
        runtime.ladder_json, media_type="application/json", headers={"x-ladder-version": runtime.ladder_version}
    )
