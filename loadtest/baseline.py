"""The plain way to serve one ONNX file of a ladder: the baseline that Anytime is measured against.

What an unremarkable deployment writes: a pydantic JSON body, base64 + PIL decoding, a plain `def`
endpoint (FastAPI runs it in its thread pool), `session.run`. No planner, no queue, no refusal: every
request is run. It imports nothing from `service/`, runs under the same uvicorn flags as `anytime serve`
(uvloop, httptools, no access log; a test checks they agree) and the same ONNX Runtime session options as
Anytime's engines, so a comparison measures the request path, not the engine. An ASGI middleware stamps
arrival for `latency_ms` exactly as the service does.

    python -m loadtest.baseline --ladder ladders/default --rung exit1.int8.onnxruntime --port 8001
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from engines.backends.onnxruntime import session_options
from loadtest.harness import free_port, running_process

UVICORN_FLAGS: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "access_log": False,
    "server_header": False,
    "date_header": False,
    "proxy_headers": False,
}


class BaselineRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the service's other options (policy, ...) are ignored

    image: str
    deadline_ms: float = Field(..., ge=1, le=60000)


def baseline_rung(manifest: dict[str, Any]) -> str:
    """The default: the FP32 ONNX Runtime rung of the last exit, the model as exported with nothing done to it."""
    plain = [
        r
        for r in manifest["rungs"]
        if r["kind"] == "exit" and r["precision"] == "fp32" and r["backend"] == "onnxruntime"
    ]
    if not plain:
        raise ValueError("the ladder has no fp32 onnxruntime exit rung to serve as the baseline")
    return str(max(plain, key=lambda r: r["exit"])["name"])


def create_baseline_app(ladder_dir: Path, rung: str | None = None, threads: int | None = None) -> FastAPI:
    manifest = json.loads((Path(ladder_dir) / "ladder.json").read_text())
    rung = rung or baseline_rung(manifest)
    records = {r["name"]: r for r in manifest["rungs"] if r["backend"] == "onnxruntime"}
    if rung not in records:
        raise ValueError(f"no onnxruntime rung {rung!r} in {ladder_dir}")
    record, pre = records[rung], manifest["preprocess"]
    opts = session_options(threads or manifest["threads"])
    session = ort.InferenceSession(str(Path(ladder_dir) / record["artifact"]["path"]), opts)
    mean = np.asarray(pre["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(pre["std"], np.float32).reshape(1, -1, 1, 1)
    _, h, w = pre["input_shape"]
    name = session.get_inputs()[0].name
    session.run(None, {name: np.zeros((1, *pre["input_shape"]), np.float32)})  # warm-up
    app = FastAPI(title="Anytime baseline", description=f"{rung} on ONNX Runtime, served plainly.")

    app.add_middleware(_Stamp)

    @app.get("/readyz")
    def ready() -> dict[str, str]:
        return {"status": "ready"}  # the session is loaded and warmed before the app exists

    @app.post("/v1/classify")
    def classify(body: BaselineRequest, request: Request) -> Any:
        try:
            image = Image.open(io.BytesIO(base64.b64decode(body.image, validate=True))).convert("L").resize((w, h))
        except Exception as e:
            return JSONResponse({"code": "bad_image", "message": f"cannot decode the image: {e}"}, status_code=400)
        x = (np.asarray(image, np.float32)[None, None] / 255.0 - mean) / std
        label = int(np.argmax(session.run(None, {name: x})[-1]))
        arrival, finished = request.state.arrival, time.monotonic()
        return {
            "label": label,
            "class_name": manifest["class_names"][label],
            "rung": rung,
            "policy": "baseline",
            "exit": record["exit"],
            "latency_ms": round((finished - arrival) * 1e3, 3),
            "deadline_ms": body.deadline_ms,
            "deadline_met": finished <= arrival + body.deadline_ms / 1e3,
        }

    return app


class _Stamp:
    """Arrival time, stamped as the service's middleware does (a pure ASGI middleware: it costs nothing)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        await self.app(scope, receive, send)


def create_floor_app() -> FastAPI:
    """The floor: a bare FastAPI constant endpoint, what any request costs before it does anything."""
    app = FastAPI(title="Anytime floor")

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/classify")
    async def classify() -> dict[str, Any]:
        return {"label": 0, "latency_ms": 0.0, "deadline_met": True}

    return app


@contextmanager
def running_baseline(
    ladder_dir: Path, rung: str | None = None, timeout_s: float = 120, floor: bool = False, log: Path | None = None
) -> Iterator[str]:
    """Start the baseline (or the floor) as its own process on a free loopback port; yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.baseline", "--ladder", str(ladder_dir), "--port", str(port)]
    argv += (["--rung", rung] if rung else []) + (["--floor"] if floor else [])
    with running_process(argv, port, timeout_s, log_path=log) as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--rung", help="an onnxruntime rung of the ladder (default: the FP32 last exit)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, help="engine threads (default: the ladder's)")
    parser.add_argument("--floor", action="store_true", help="serve a constant answer instead (the floor)")
    args = parser.parse_args(argv)
    app = create_floor_app() if args.floor else create_baseline_app(args.ladder, args.rung, args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **UVICORN_FLAGS)


if __name__ == "__main__":
    main()
