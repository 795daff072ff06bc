"""The plain way to serve one ONNX file of a ladder: the baseline that Anytime is measured against.

What an unremarkable deployment writes: a pydantic JSON body, base64 + PIL decoding, a plain `def`
endpoint (FastAPI runs it in its thread pool), `session.run`. No planner, no queue, no refusal: every
request is run. It imports nothing from `service/`, runs under the same uvicorn flags as `anytime serve`
(uvloop, httptools, no access log; a test checks they agree) and the same ONNX Runtime session options as
Anytime's engines, so a comparison measures the request path, not the engine. An ASGI middleware stamps
arrival for `latency_ms` exactly as the service does.

    python -m loadtest.baseline --ladder ladders/default --rung exit1.int8.onnxruntime --port 8001

Two more references for `bench.frontdoor`, not baselines: `--floor`, a FastAPI constant endpoint (what any request
costs before it does anything), and `--lean`, the same model served as lean as FastAPI allows (an `async` route on
the raw body, orjson both ways, the engine run inline on the event loop: what a request can cost around the engine
on this machine, with nothing of a production server's, not even a thread for a slow engine).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
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


class _Model:
    """One ONNX Runtime rung of a ladder, loaded and warmed, with its preprocessing: base64 PNG/JPEG -> label."""

    def __init__(self, ladder_dir: Path, rung: str | None, threads: int | None) -> None:
        self.manifest = json.loads((Path(ladder_dir) / "ladder.json").read_text())
        self.rung = rung or baseline_rung(self.manifest)
        records = {r["name"]: r for r in self.manifest["rungs"] if r["backend"] == "onnxruntime"}
        if self.rung not in records:
            raise ValueError(f"no onnxruntime rung {self.rung!r} in {ladder_dir}")
        self.record, pre = records[self.rung], self.manifest["preprocess"]
        opts = session_options(threads or self.manifest["threads"])
        self.session = ort.InferenceSession(str(Path(ladder_dir) / self.record["artifact"]["path"]), opts)
        self.mean = np.asarray(pre["mean"], np.float32).reshape(1, -1, 1, 1)
        self.std = np.asarray(pre["std"], np.float32).reshape(1, -1, 1, 1)
        _, self.h, self.w = pre["input_shape"]
        self.input = self.session.get_inputs()[0].name
        self.session.run(None, {self.input: np.zeros((1, *pre["input_shape"]), np.float32)})  # warm-up

    def decode(self, image_b64: str) -> np.ndarray:
        """The model input (raises on an image that cannot be decoded)."""
        data = base64.b64decode(image_b64, validate=True)
        image = Image.open(io.BytesIO(data)).convert("L").resize((self.w, self.h))
        return (np.asarray(image, np.float32)[None, None] / 255.0 - self.mean) / self.std

    def label(self, x: np.ndarray) -> int:
        return int(np.argmax(self.session.run(None, {self.input: x})[-1]))

    def answer(self, label: int, policy: str, arrival: float, deadline_ms: float) -> dict[str, Any]:
        finished = time.monotonic()
        return {
            "label": label,
            "class_name": self.manifest["class_names"][label],
            "rung": self.rung,
            "policy": policy,
            "exit": self.record["exit"],
            "latency_ms": round((finished - arrival) * 1e3, 3),
            "deadline_ms": deadline_ms,
            "deadline_met": finished <= arrival + deadline_ms / 1e3,
        }


def _app(title: str, description: str = "") -> FastAPI:
    """A FastAPI app that is ready as soon as it exists (any model is loaded and warmed before it)."""
    app = FastAPI(title=title, description=description)

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    return app


def create_baseline_app(ladder_dir: Path, rung: str | None = None, threads: int | None = None) -> FastAPI:
    model = _Model(ladder_dir, rung, threads)
    app = _app("Anytime baseline", f"{model.rung} on ONNX Runtime, served plainly.")
    app.add_middleware(_Stamp)

    @app.post("/v1/classify")
    def classify(body: BaselineRequest, request: Request) -> Any:
        try:
            x = model.decode(body.image)
        except Exception as e:
            return JSONResponse({"code": "bad_image", "message": f"cannot decode the image: {e}"}, status_code=400)
        return model.answer(model.label(x), "baseline", request.state.arrival, body.deadline_ms)

    return app


def create_lean_app(ladder_dir: Path, rung: str | None = None, threads: int | None = None) -> FastAPI:
    """The same model as lean as FastAPI allows: `async`, the raw body, orjson both ways, the engine inline."""
    model = _Model(ladder_dir, rung, threads)
    app = _app("Anytime lean reference", f"{model.rung} on ONNX Runtime, inline on the loop.")
    app.add_middleware(_Stamp)

    @app.post("/v1/classify")
    async def classify(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
            x, deadline_ms = model.decode(body["image"]), float(body["deadline_ms"])
        except Exception as e:
            error = {"code": "bad_request", "message": f"cannot read the request: {type(e).__name__}: {e}"}
            return Response(orjson.dumps(error), 400, media_type="application/json")
        answer = model.answer(model.label(x), "lean", request.scope["state"]["arrival"], deadline_ms)
        return Response(orjson.dumps(answer), media_type="application/json")

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
    app = _app("Anytime floor")

    @app.post("/v1/classify")
    async def classify() -> dict[str, Any]:
        return {"label": 0, "latency_ms": 0.0, "deadline_met": True}

    return app


@contextmanager
def running_baseline(
    ladder_dir: Path,
    rung: str | None = None,
    timeout_s: float = 120,
    floor: bool = False,
    log: Path | None = None,
    lean: bool = False,
    wrap: Sequence[str] = (),
) -> Iterator[str]:
    """Start the baseline (or the floor, or the lean reference) as its own process on a free loopback port; yields
    its URL. `wrap`: a command it runs under (e.g. valgrind's, bench/instructions.py)."""
    port = free_port()
    argv = [*wrap, sys.executable, "-m", "loadtest.baseline", "--ladder", str(ladder_dir), "--port", str(port)]
    argv += (["--rung", rung] if rung else []) + (["--floor"] if floor else []) + (["--lean"] if lean else [])
    with running_process(argv, port, timeout_s, log_path=log) as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--rung", help="an onnxruntime rung of the ladder (default: the FP32 last exit)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, help="engine threads (default: the ladder's)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--floor", action="store_true", help="serve a constant answer instead (the floor)")
    form.add_argument("--lean", action="store_true", help="serve the rung as lean as FastAPI allows (a reference)")
    args = parser.parse_args(argv)
    if args.floor:
        app = create_floor_app()
    elif args.lean:
        app = create_lean_app(args.ladder, args.rung, args.threads)
    else:
        app = create_baseline_app(args.ladder, args.rung, args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **UVICORN_FLAGS)


if __name__ == "__main__":
    main()
