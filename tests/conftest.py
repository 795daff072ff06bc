from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engines.manifest import Ladder, Rung, load_ladder
from models.checkpoint import DEFAULT_CHECKPOINT, Checkpoint, load_checkpoint
from models.data import FashionMNIST


@pytest.fixture(scope="session", autouse=True)
def _cpu_determinism() -> None:
    torch.set_flush_denormal(True)
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def fmnist() -> FashionMNIST:
    """The real Fashion-MNIST (make test installs Debian's dataset-fashion-mnist)."""
    return FashionMNIST()


@pytest.fixture(scope="session")
def default_checkpoint(fmnist: FashionMNIST) -> Checkpoint:
    return load_checkpoint(DEFAULT_CHECKPOINT, fmnist)


@pytest.fixture(scope="session")
def default_ladder_dir() -> Path:
    """The default ladder (make test builds it first; built here if it is missing)."""
    directory = Path(os.environ.get("ANYTIME_TEST_LADDER", "ladders/default"))
    if not (directory / "ladder.json").is_file():
        from engines.build import BuildConfig, build_ladder

        build_ladder(DEFAULT_CHECKPOINT, directory, BuildConfig(progress=False))
    return directory


@pytest.fixture(scope="session")
def default_ladder(default_ladder_dir: Path) -> Ladder:
    return load_ladder(default_ladder_dir)


@pytest.fixture(scope="session")
def ladder_dir(default_ladder_dir: Path) -> Path:
    """The ladder the unit and service tests run on."""
    return default_ladder_dir


@pytest.fixture(scope="session")
def ladder(ladder_dir: Path) -> Ladder:
    return load_ladder(ladder_dir)


def last_exit(ladder: Ladder, precision: str = "fp32") -> Rung:
    """The ladder's last exit in `precision` on ONNX Runtime (every ladder has one)."""
    exits = [r for r in ladder.rungs if r.kind == "exit" and r.precision == precision and r.backend == "onnxruntime"]
    return max(exits, key=lambda r: r.exit)
