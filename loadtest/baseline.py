"""The same model served the plain way, to measure what the planner buys.

A tiny FastAPI app: POST /v1/classify decodes the image exactly as the service does (`service.images`),
runs the ladder's FP32 last-exit ONNX Runtime engine and answers. No planner, no queue, no rejection:
every request is run. The handler is a plain `def`, so FastAPI runs it in its thread pool, which is what
an unremarkable deployment does. `latency_ms` and `deadline_met` come from the same arrival stamp as the
service's (its `StampAndLimit` middleware), so the two are measured alike.

    python -m loadtest.baseline --ladder ladders/default --port 8001
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from engines.base import Backend, Precision
from engines.factory import open_engine
from engines.manifest import Ladder, Rung, load_ladder
from loadtest.harness import free_port, running_process
from models.data import PreprocessSpec
from service.app import StampAndLimit
from service.errors import install_error_handlers
from service.images import decode_array, decode_base64, to_input


class BaselineRequest(BaseModel):
    # The load generator sends the service's options too (policy, on_infeasible, ...); they are ignored here.
    model_config = ConfigDict(extra="ignore")

    image: str | list[Any]
    deadline_ms: float = Field(..., ge=1, le=60000)


def baseline_rung(ladder: Ladder) -> Rung:
    """The FP32 ONNX Runtime rung of the last exit: the model as exported, with nothing done to it."""
    plain = [
        r
        for r in ladder.rungs
        if r.kind == "exit" and r.precision is Precision.FP32 and r.backend is Backend.ONNXRUNTIME
    ]
    if not plain:
        raise ValueError("the ladder has no fp32 onnxruntime exit rung to serve as the baseline")
    return max(plain, key=lambda r: r.exit)


def create_baseline_app(ladder_dir: Path, threads: int | None = None) -> FastAPI:
    ladder = load_ladder(ladder_dir)
    rung = baseline_rung(ladder)
    spec = PreprocessSpec.from_dict(ladder.preprocess)
    engine = open_engine(
        rung.backend, ladder_dir / rung.artifact.path, rung.precision, threads or ladder.threads, rung.artifact.sha256
    )
    engine.warmup((1,))
    app = FastAPI(title="Anytime baseline", description="The last exit in FP32 on ONNX Runtime, served plainly.")

    install_error_handlers(app)

    @app.get("/healthz")
    @app.get("/readyz")
    def ready() -> dict[str, str]:
        return {"status": "ready"}  # the engine is loaded and warmed before the app exists

    @app.post("/v1/classify")
    def classify(body: BaselineRequest, request: Request) -> dict[str, Any]:
        arrival = request.scope["state"]["arrival"]
        image = decode_base64(body.image) if isinstance(body.image, str) else decode_array(body.image)
        x, _ = to_input(image, spec)
        logits = engine.infer(x)[0]
        finished = time.monotonic()
        label = int(np.argmax(logits))
        return {
            "label": label,
            "class_name": ladder.class_names[label],
            "rung": rung.name,
            "policy": "baseline",
            "exit": rung.exit,
            "precision": str(rung.precision),
            "backend": str(rung.backend),
            "latency_ms": round((finished - arrival) * 1e3, 3),
            "deadline_ms": body.deadline_ms,
            "deadline_met": finished <= arrival + body.deadline_ms / 1e3,
        }

    app.add_middleware(StampAndLimit, max_body_bytes=4 * 1024 * 1024)
    return app


@contextmanager
def running_baseline(ladder_dir: Path, timeout_s: float = 120) -> Iterator[str]:
    """Start the baseline as its own process on a free loopback port; yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.baseline", "--ladder", str(ladder_dir), "--port", str(port)]
    with running_process(argv, port, timeout_s) as url:
        yield url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, help="engine threads (default: the ladder's)")
    args = parser.parse_args(argv)
    uvicorn.run(create_baseline_app(args.ladder, args.threads), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
