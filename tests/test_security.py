"""Security basics over a real server: the optional API key, request ids in headers, answers and logs, JSON
logs, and the ladder's version in every answer. Uses the default ladder."""

from __future__ import annotations

import hashlib
import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.manifest import MANIFEST_NAME
from loadtest.harness import running_server
from models.data import FashionMNIST
from service.app import create_app
from service.config import Settings

pytestmark = pytest.mark.slow

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security") / "server.log"


@pytest.fixture(scope="module")
def server(ladder_dir: Path, server_log: Path) -> Iterator[str]:
    env = {
        "ANYTIME_API_KEY": KEY,
        "ANYTIME_API_KEY_METRICS": "true",
        "ANYTIME_LOG_FORMAT": "json",
        "ANYTIME_ACCESS_LOG": "true",
    }
    with running_server(ladder_dir, log=server_log, **env) as url:
        yield url


@pytest.fixture(scope="module")
def png(fmnist: FashionMNIST) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(fmnist.split("test").images[0]).save(buf, "PNG")
    return buf.getvalue()


def _classify(client: httpx.Client, png: bytes, **headers: str) -> httpx.Response:
    return client.post(
        "/v1/classify?deadline_ms=1000",
        content=png,
        headers={"content-type": "image/png", **{k.replace("_", "-"): v for k, v in headers.items()}},
    )


def test_v1_routes_need_the_key_and_say_how(client: httpx.Client, png: bytes) -> None:
    for r in (_classify(client, png), client.get("/v1/ladder")):
        assert r.status_code == 401, r.text
        assert r.json()["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.headers["x-request-id"]
    wrong = _classify(client, png, authorization="Bearer not-the-key")
    assert wrong.status_code == 401 and "invalid_token" in wrong.headers["www-authenticate"]
    assert _classify(client, png, authorization=f"Basic {KEY}").status_code == 401
    assert _classify(client, png, **AUTH).status_code == 200
    assert client.get("/v1/ladder", headers=AUTH).status_code == 200


def test_health_stays_open_and_metrics_can_be_closed(client: httpx.Client) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/metrics").status_code == 401  # ANYTIME_API_KEY_METRICS=true
    metrics = client.get("/metrics", headers=AUTH)
    assert metrics.status_code == 200 and "process_resident_memory_bytes" in metrics.text  # what a soak watches


def test_the_key_is_checked_before_the_body_is_read(server: str) -> None:
    """The HTTP parser's admission refuses a keyless request while its announced 1 MiB body is still unsent."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ncontent-length: 1048576\r\n\r\n"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
    assert b"x-request-id:" in head.lower()


def test_the_request_id_is_taken_or_made_and_returned_everywhere(client: httpx.Client, png: bytes) -> None:
    r = _classify(client, png, **AUTH, x_request_id="trace-42.a")
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42.a" and r.json()["request_id"] == "trace-42.a"
    made = _classify(client, png, **AUTH, x_request_id="has spaces and {braces}")  # not a sane token
    assert made.headers["x-request-id"] not in ("", "has spaces and {braces}")
    assert made.json()["request_id"] == made.headers["x-request-id"]
    other = _classify(client, png, **AUTH)
    assert other.headers["x-request-id"] != made.headers["x-request-id"]
    assert client.get("/healthz", headers={"x-request-id": "hz-1"}).headers["x-request-id"] == "hz-1"
    bad = client.post("/v1/classify", content=b"not an image", headers={**AUTH, "content-type": "image/png"})
    assert bad.status_code in (400, 422) and bad.headers["x-request-id"]
    batch = client.post(
        "/v1/classify/batch", json={"images": [], "deadline_ms": 100}, headers={**AUTH, "x-request-id": "b-7"}
    )
    assert batch.status_code in (400, 422) and batch.headers["x-request-id"] == "b-7"


def test_logs_are_json_lines_that_carry_the_request_id(client: httpx.Client, png: bytes, server_log: Path) -> None:
    _classify(client, png, **AUTH, x_request_id="logged-1")
    client.get("/readyz")  # flushes nothing, but gives the access log a second line to be read after
    lines = [line for line in server_log.read_text().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line, uvicorn's start-up lines included
    assert all({"time", "level", "logger", "request_id", "message"} <= e.keys() for e in entries)
    mine = [e for e in entries if e["request_id"] == "logged-1"]
    assert mine and mine[0]["logger"] == "anytime.access" and mine[0]["status"] == 200
    assert mine[0]["path"] == "/v1/classify" and mine[0]["duration_ms"] > 0
    assert not any(e["level"] == "ERROR" or "exc_info" in e for e in entries), lines[-20:]


def test_every_answer_names_the_ladder_version(client: httpx.Client, png: bytes, ladder_dir: Path) -> None:
    version = hashlib.sha256((ladder_dir / MANIFEST_NAME).read_bytes()).hexdigest()[:12]
    assert _classify(client, png, **AUTH).json()["ladder_version"] == version
    assert client.get("/readyz").json()["ladder_version"] == version
    assert client.get("/v1/ladder", headers=AUTH).headers["x-ladder-version"] == version
    image = np.asarray(Image.open(io.BytesIO(png))).tolist()
    batch = client.post("/v1/classify/batch", json={"images": [image, image], "deadline_ms": 1000}, headers=AUTH).json()
    assert [a["ladder_version"] for a in batch["results"]] == [version, version]


def test_without_a_key_everything_is_open_and_openapi_says_so(ladder_dir: Path) -> None:
    with TestClient(create_app(Settings(ladder=ladder_dir))) as c:
        assert c.get("/v1/ladder").status_code == 200
        assert "securitySchemes" not in c.get("/openapi.json").json().get("components", {})


def test_with_a_key_metrics_stay_open_unless_asked_and_openapi_declares_the_bearer(ladder_dir: Path) -> None:
    with TestClient(create_app(Settings(ladder=ladder_dir, api_key=KEY))) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/ladder").status_code == 401
        schema = c.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        classify = schema["paths"]["/v1/classify"]["post"]
        assert classify["security"] == [{"bearer": []}] and "401" in classify["responses"]
        assert "security" not in schema["paths"]["/healthz"]["get"]
