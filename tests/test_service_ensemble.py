"""The service on the default ladder's ensemble rungs: planned like any rung, answers name their members."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.manifest import Ladder
from models.data import FashionMNIST
from service.app import create_app
from service.config import Settings
from service.planner import OnInfeasible, Planner, Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(default_ladder_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(ladder=default_ladder_dir))) as c:
        deadline = time.monotonic() + 60
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        yield c


def test_ladder_lists_ensembles_with_members(client: TestClient, default_ladder: Ladder) -> None:
    assert default_ladder.ensembles, "the default build keeps at least one ensemble on the front"
    body = client.get("/v1/ladder").json()
    rungs = {r["name"] for r in body["rungs"]}
    for e in body["ensembles"]:
        assert len(e["members"]) >= 2 and set(e["members"]) <= rungs
        assert e["stacker"] in ("logistic_regression", "mlp") and e["artifact"]["sha256"]
    assert len(body["ensemble_search"]) >= len(body["ensembles"])


def test_an_ensemble_answers_and_names_its_members(
    client: TestClient, default_ladder: Ladder, fmnist: FashionMNIST
) -> None:
    ensemble = default_ladder.ensembles[0]
    image = fmnist.split("test").images[0]
    body = client.post(
        "/v1/classify",
        json={"image": image.tolist(), "deadline_ms": 5000, "policy": "fixed", "rung": ensemble.name, "top_k": 10},
    ).json()
    assert body["rung"] == ensemble.name and body["members"] == ensemble.members
    assert body["exit"] == 0 and body["precision"] == str(ensemble.precision)
    assert np.isclose(sum(t["probability"] for t in body["top_k"]), 1.0, atol=1e-4)


def test_static_policy_may_choose_an_ensemble(default_ladder: Ladder) -> None:
    """With ensembles among the candidates, a loose deadline gets the most accurate non-dominated answer."""
    from service.predictor import LatencyPredictor

    records = [*default_ladder.rungs, *default_ladder.ensembles]
    planner = Planner(default_ladder, LatencyPredictor(records), margin_ms=1.0)
    best = max((r for r in records if not r.dominated), key=lambda r: r.val_accuracy)
    assert planner.plan(Policy.STATIC, 5000, 0, OnInfeasible.REJECT).name == best.name
    assert {e.name for e in default_ladder.ensembles if not e.dominated} <= {r.name for r in planner.static}
