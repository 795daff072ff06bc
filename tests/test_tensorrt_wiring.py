"""The TensorRT path end to end on a CPU: `anytime build --backend tensorrt` -> ladder.json -> factory -> engine ->
the service answering HTTP, with only the TensorRT and CUDA calls substituted (tests/fakes/): every test here
says so in its name. The plans' numbers are ONNX Runtime's; the GPU tests are in tests/engines/test_tensorrt.py.
And, unsubstituted: asking for TensorRT where it is not is one line and exit 2.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from engines.base import Backend, Precision
from engines.manifest import Ladder, load_ladder
from loadtest.harness import free_port, png_base64, running_process
from models.data import FashionMNIST
from tests.fakes import tensorrt as fake_trt
from tests.fakes.gpu import GPU_NAME
from tests.tiny_ladder import cached_tiny_ladder, store

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SUBSTITUTED = [sys.executable, "-m", "tests.fakes.gpu"]  # runs `anytime ...` with tensorrt and CUDA substituted
ANYTIME = str(Path(sys.executable).parent / "anytime")


def _has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _one_line_error(done: subprocess.CompletedProcess[str], prefix: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(prefix), done.stderr
    return done.stderr


@pytest.mark.skipif(_has_tensorrt(), reason="tensorrt is installed here")
@pytest.mark.parametrize("command", [[ANYTIME, "build"], [sys.executable, "-m", "engines.build"]])
def test_tensorrt_build_without_tensorrt_exits_2_with_one_line(command: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [*command, "--backend", "tensorrt", "--out", str(tmp_path / "ladder")], capture_output=True, text=True, cwd=ROOT
    )
    prog = "anytime build" if command[0] == ANYTIME else "python -m engines.build"
    assert "tensorrt is not installed" in _one_line_error(done, f"{prog}: error: ")
    assert not (tmp_path / "ladder").exists()  # refused before any work


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
def test_tensorrt_build_without_cuda_exits_2_with_one_line_substituted_tensorrt(tmp_path: Path) -> None:
    """TensorRT substituted, CUDA not: the message names the missing device."""
    argv = [*SUBSTITUTED, "--without-cuda", "--", "build", "--backend", "tensorrt", "--out", str(tmp_path / "ladder")]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert "no CUDA device" in _one_line_error(done, "anytime build: error: ")


# -- the whole path, substituted -------------------------------------------------------------------------------

TINY_CLI = ["--calib-samples", "200", "--runs", "60", "--min-runs", "20", "--max-seconds", "0.2", "--quiet"]


@pytest.fixture(scope="module")
def plan_ladder_dir(tiny_ladder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ladder rebuilt by `anytime build --backend tensorrt` (substituted). Its directory is copied with
    the build cache, so only the TensorRT steps run; no members, so no ensembles to refit. Kept beside the tiny
    ladder in its cache (tests/tiny_ladder.py), keyed also by the CLI, the substitutes and this file: a later
    session copies it (28 s of the quick loop here). Not with a given tiny ladder (ANYTIME_TEST_TINY_LADDER)."""
    out = tmp_path_factory.mktemp("plans") / "ladder"
    given = bool(os.environ.get("ANYTIME_TEST_TINY_LADDER"))
    cached = (
        None
        if given
        else cached_tiny_ladder("tiny-plan-ladder", ("cli", "tests/fakes", "tests/test_tensorrt_wiring.py"))
    )
    if cached is not None and (cached / "ladder.json").is_file():
        shutil.copytree(cached, out)
        return out
    shutil.copytree(tiny_ladder_dir, out)
    checkpoint = tiny_ladder_dir.parent / "resnet_exits_tiny.pt"
    argv = [*SUBSTITUTED, "--", "build", str(checkpoint), "--members", "--out", str(out), "--backend", "tensorrt"]
    done = subprocess.run([*argv, *TINY_CLI], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    if cached is not None:
        store(out, cached)
    return out


@pytest.fixture(scope="module")
def plan_ladder(plan_ladder_dir: Path) -> Ladder:
    return load_ladder(plan_ladder_dir)


def test_build_writes_plan_rungs_stages_and_cascades_substituted(plan_ladder: Ladder, plan_ladder_dir: Path) -> None:
    plans = [r for r in plan_ladder.rungs if r.backend is Backend.TENSORRT]
    graphs = {r.name.split(".")[0] for r in plan_ladder.rungs if r.backend is Backend.ONNXRUNTIME}
    assert {r.name for r in plans} == {f"{g}.{p}.tensorrt" for g in graphs for p in ("fp32", "fp16", "int8")}
    for r in plans:
        assert r.plan is not None and r.max_batch == r.plan.max_batch == 32
        assert (r.plan.min_batch, r.plan.opt_batch) == (1, 8)
        assert (r.plan.gpu_name, r.plan.compute_capability, r.plan.cuda_version) == (GPU_NAME, "8.7", "12.6")
        assert r.plan.tensorrt_version == "10.0.1" and r.artifact.path == f"plans/{r.name.rsplit('.', 1)[0]}.plan"
        # FP16 by builder flag on the FP32 file; INT8 from the symmetric QDQ file (TensorRT 10).
        source = r.name.split(".")[0] + (".int8.trt.onnx" if r.precision is Precision.INT8 else ".fp32.onnx")
        assert r.plan.source.path == source and r.plan.int8 == ("qdq" if r.precision is Precision.INT8 else None)
        header, _ = fake_trt.read_plan((plan_ladder_dir / r.artifact.path).read_bytes())
        assert ("FP16" in header["flags"]) == (r.precision is not Precision.FP32)
        assert ("INT8" in header["flags"]) == (r.precision is Precision.INT8)
        assert r.profile(32).runs >= 20 and 0 <= r.test_accuracy <= 1
    cascades = {c.name: c for c in plan_ladder.cascades if c.backend is Backend.TENSORRT}
    assert set(cascades) == {f"cascade.{p}.tensorrt" for p in ("fp32", "fp16", "int8")}
    for c in cascades.values():
        assert all(plan_ladder.stage(s).plan is not None for s in c.stages)
    assert plan_ladder.software["tensorrt"] == "10.0.1" and plan_ladder.machine["gpu"] == GPU_NAME
    (cache,) = (plan_ladder_dir / "plans").glob("timing.*.cache")  # one timing cache, every plan built with it
    n_plans = len(plans) + sum(len(c.stages) for c in cascades.values())
    assert len(fake_trt._TimingCache(cache.read_bytes()).entries) == n_plans


def test_fp32_plans_answer_as_their_onnx_files_substituted(plan_ladder: Ladder, plan_ladder_dir: Path) -> None:
    """The substitute runs the plan's own ONNX file, so the FP32 plan rung's logits equal its ONNX Runtime twin's:
    what went through the buffers, addresses and shapes came back in order."""
    for r in plan_ladder.rungs:
        if r.backend is Backend.TENSORRT and r.precision is Precision.FP32:
            twin = plan_ladder.rung(r.name.replace(".tensorrt", ".onnxruntime"))
            # Equal but for ONNX Runtime's rounding at another batch size (500 there, the plan's 32 here).
            assert abs(r.val_accuracy - twin.val_accuracy) < 5e-4 and abs(r.test_accuracy - twin.test_accuracy) < 5e-4


@pytest.fixture(scope="module")
def substituted_server(plan_ladder_dir: Path) -> Iterator[str]:
    """`anytime serve` on the plan ladder, substituted; max_batch far above the plans' profile (32)."""
    port = free_port()
    argv = [*SUBSTITUTED, "--", "serve", "--ladder", str(plan_ladder_dir), "--port", str(port)]
    with running_process(argv, port, 120, {"ANYTIME_MAX_BATCH": "256", "PYTHONPATH": str(ROOT)}) as url:
        yield url


def _classify(url: str, image: np.ndarray, rung: str) -> dict[str, object]:
    body = {"image": png_base64(image), "deadline_ms": 30000, "policy": "fixed", "rung": rung}
    answer = httpx.post(f"{url}/v1/classify", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_service_answers_through_plan_rungs_and_cascades_substituted(
    substituted_server: str, plan_ladder: Ladder, fmnist: FashionMNIST
) -> None:
    images = fmnist.split("test").head(20).images
    for rung in ("exit3.fp32.tensorrt", "exit3.int8.tensorrt", "cascade.fp16.tensorrt"):
        for image in images[:5]:
            answer = _classify(substituted_server, image, rung)
            assert answer["rung"] == rung and answer["backend"] == "tensorrt"
    # The FP32 plan answers exactly as the ONNX Runtime rung of the same graph.
    for image in images:
        plan = _classify(substituted_server, image, "exit3.fp32.tensorrt")
        twin = _classify(substituted_server, image, "exit3.fp32.onnxruntime")
        assert plan["label"] == twin["label"] and abs(plan["entropy"] - twin["entropy"]) < 1e-4  # type: ignore[operator]


def test_batches_are_capped_at_the_plans_profile_substituted(substituted_server: str, fmnist: FashionMNIST) -> None:
    """256 images under one deadline, ANYTIME_MAX_BATCH=256: a plan whose profile stops at 32 never gets more
    (it would refuse the batch and leave service), and the queued images still share runs."""
    images = fmnist.split("test").head(256).images
    query = "deadline_ms=30000&policy=fixed&rung=exit2.fp32.tensorrt&dtype=uint8&shape=256,28,28"
    answer = httpx.post(
        f"{substituted_server}/v1/classify/batch?{query}",
        content=np.ascontiguousarray(images).tobytes(),
        headers={"content-type": "application/x-tensor"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert len(results) == 256 and {r["rung"] for r in results} == {"exit2.fp32.tensorrt"}
    sizes = [b for r in results for b in r["batch_sizes"]]
    assert max(sizes) <= 32 and max(sizes) > 1, sorted(set(sizes))


def test_plan_from_another_tensorrt_version_is_refused_substituted(plan_ladder_dir: Path, tmp_path: Path) -> None:
    """The server of a machine with another TensorRT version never turns ready: /readyz says load_failed and
    the log names both versions."""
    port = free_port()
    argv = [*SUBSTITUTED, "--tensorrt-version", "10.1.0", "--", "serve", "--ladder", str(plan_ladder_dir)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        body: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while body.get("code") != "load_failed" and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            except httpx.TransportError:
                continue
            assert answer.status_code == 503
            body = answer.json()
        assert body.get("code") == "load_failed"
        assert "was built by TensorRT 10.0.1, this is 10.1.0" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_engine_benchmark_times_the_ladders_plans_substituted(
    plan_ladder: Ladder, plan_ladder_dir: Path, ladder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m bench.engines` opens each exit's plan rungs where the ladder has them, and none on a CPU ladder
    (a plan is never built on the fly: it belongs to one GPU and TensorRT version)."""
    from bench.engines import PLANS, _open
    from tests.fakes.gpu import substitute

    substitute(monkeypatch.setitem, monkeypatch.setattr)
    for precision, backend in PLANS:
        opened = _open(plan_ladder_dir, plan_ladder, 1, precision, backend)
        assert opened is not None, precision
        size, engine = opened
        assert size == plan_ladder.rung(f"exit1.{precision}.tensorrt").artifact.bytes
        assert engine.run(np.zeros((1, *plan_ladder.rung("exit1.fp32.onnxruntime").input_shape), np.float32))
        assert _open(ladder_dir, load_ladder(ladder_dir), 1, precision, backend) is None
