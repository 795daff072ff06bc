from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.deps import RuntimeDep

router = APIRouter(prefix="/v1", tags=["ladder"])


@router.get("/ladder")
def get_ladder(runtime: RuntimeDep) -> dict[str, Any]:
    """Rungs, ensembles (with members and stacker), stages and cascades with profiles, as the builder wrote them."""
    return runtime.ladder.model_dump(mode="json")
