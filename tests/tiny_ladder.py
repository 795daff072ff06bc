"""The tiny ladder the unit and service tests run on, and a command that builds it once for many test sessions.

A 3-exit ResNet of 8/16/32 channels and a 2-stage VGG member of 8/16, each trained for two epochs on 6,000
images, built with short profiles. Every step of the real build runs on real models (export, calibration,
probe, measurement, cut search, thresholds, ensembles); only the sizes are small. A test session builds it
in 20-50 s (tests/conftest.py, `tiny_ladder_dir`). Many short sessions (scripts/mutation.sh: one per mutant)
build it once instead:

    python -m tests.tiny_ladder OUT                      # OUT/ladder, OUT/resnet_exits_tiny.pt, OUT/vgg_tiny.pt
    ANYTIME_TEST_TINY_LADDER=OUT python -m pytest ...    # each session copies OUT instead of building

Without that, a session keeps the ladder it built in a cache outside the checkout ($XDG_CACHE_HOME or ~/.cache,
anytime/tiny-ladder-<key>), and later sessions copy it. The key hashes what the ladder is made from: this
recipe, the sources of the packages that train and build (models, calibration, engines), and the versions of
Python and the packages they use; a change to any of them builds afresh. ANYTIME_TEST_TINY_LADDER_CACHE=0 turns
the cache off (each session builds); =DIR puts it in DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

from engines.base import Precision
from engines.ensemble import StackerKind
from models.data import FashionMNIST
from models.train import TrainConfig

TINY_RESNET = TrainConfig(
    model="resnet_exits",
    model_config={"widths": (8, 16, 32), "blocks": (1, 1, 1), "stem_stride": 2, "exit_pool": 2},
    epochs=2,
    limit=6000,
    lr=0.2,
    batch_size=64,
    seed=1,
)
TINY_VGG = TrainConfig(
    model="vgg", model_config={"widths": (8, 16), "blocks": (1, 1)}, epochs=2, limit=6000, lr=0.1, batch_size=64
)
TINY_BUILD = {
    "calib_samples": 200,
    "runs": 60,
    "min_runs": 20,
    "max_seconds": 0.2,
    "progress": False,
    "stackers": (StackerKind.LOGISTIC,),  # the MLP's cross-validation takes seconds
    # INT8 whether or not it pays on this machine (the probe leaves it out on x86 without VNNI): the tests cover it.
    "precisions": (Precision.INT8,),
}


CACHE_ENV = "ANYTIME_TEST_TINY_LADDER_CACHE"
SOURCES = ("models", "calibration", "engines")  # what trains and builds a ladder
DEPENDENCIES = ("torch", "onnx", "onnxruntime", "openvino", "numpy", "scikit-learn", "skl2onnx", "onnxconverter-common")


def cached_tiny_ladder(name: str = "tiny-ladder", also: tuple[str, ...] = ()) -> Path | None:
    """Where the cache keeps the tiny ladder of this checkout's sources (it may not be there yet); None: no cache.
    `name` and `also` (more paths whose .py files the key hashes) name something else made from it: the
    substituted TensorRT ladder of tests/test_tensorrt_wiring.py."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting == "0":
        return None
    base = Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "anytime"
    return base / f"{name}-{_key(also)}"


def store(built: Path, cached: Path) -> None:
    """Keep what a session built for later sessions: copied beside its place, then renamed into it (atomic: a
    session that reads the cache sees all of it or none; of two sessions that built one, the first stays)."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = cached.parent / f".{cached.name}.{os.getpid()}"
    shutil.copytree(built, staging)
    try:
        staging.rename(cached)
    except OSError:  # another session stored it first
        shutil.rmtree(staging, ignore_errors=True)


def _key(also: tuple[str, ...] = ()) -> str:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    files = [Path(__file__).resolve(), *sorted(f for p in (*SOURCES, *also) for f in _py_files(root / p))]
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in DEPENDENCIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\0".encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def _py_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else list(path.rglob("*.py"))


def build_tiny_ladder(root: Path, fmnist: FashionMNIST) -> Path:
    """Train both tiny models into `root` and build the ladder into `root/ladder`, which is returned."""
    import torch

    from engines.build import BuildConfig, build_ladder
    from models.train import train_to

    torch.set_flush_denormal(True)  # as the test session sets it (tests/conftest.py)
    torch.set_num_threads(2)
    main, member = root / "resnet_exits_tiny.pt", root / "vgg_tiny.pt"
    train_to(main, TINY_RESNET, fmnist, command="tests/tiny_ladder.py TINY_RESNET", progress=False)
    train_to(member, TINY_VGG, fmnist, command="tests/tiny_ladder.py TINY_VGG", progress=False)
    build_ladder(main, root / "ladder", BuildConfig(members=(member,), **TINY_BUILD))  # type: ignore[arg-type]
    return root / "ladder"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="an empty or new directory")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        parser.error(f"{out} is not empty")
    start = time.monotonic()
    ladder = build_tiny_ladder(out, FashionMNIST())
    print(f"built {ladder} in {time.monotonic() - start:.0f} s; use it with ANYTIME_TEST_TINY_LADDER={out}")


if __name__ == "__main__":
    main()
