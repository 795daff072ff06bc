from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from engines.manifest import Ladder, Rung, load_ladder
from models.data import FashionMNIST

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

TINY_LADDER_ENV = "ANYTIME_TEST_TINY_LADDER"


def _torch_settings() -> None:
    import torch

    torch.set_flush_denormal(True)
    torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def _cpu_determinism() -> None:
    """torch on 2 threads, denormals flushed, in every session that imports it. A session whose tests never
    import torch (the scheduler's, the routes') does not load it: 3 s saved, for each of a mutation run's
    hundreds of sessions. The fixtures that use torch themselves set it first."""
    if "torch" in sys.modules:
        _torch_settings()


@pytest.fixture(scope="session")
def fmnist() -> FashionMNIST:
    """The real Fashion-MNIST (make test installs Debian's dataset-fashion-mnist)."""
    return FashionMNIST()


@pytest.fixture(scope="session")
def default_checkpoint(fmnist: FashionMNIST) -> Checkpoint:
    from models.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint

    _torch_settings()
    return load_checkpoint(DEFAULT_CHECKPOINT, fmnist)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the real default ladder are the end-to-end group: marked `e2e` (`pytest -m "not e2e"` skips them)."""
    for item in items:
        if "default_ladder_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def default_ladder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default ladder: `make test` builds it first (ANYTIME_TEST_LADDER names another). When it is missing
    the session builds one into a temporary directory (about 2 minutes), never into the working tree."""
    directory = Path(os.environ.get("ANYTIME_TEST_LADDER", "ladders/default"))
    if (directory / "ladder.json").is_file():
        return directory
    from engines.build import BuildConfig, build_ladder
    from models.checkpoint import DEFAULT_CHECKPOINT

    _torch_settings()
    directory = tmp_path_factory.mktemp("default-ladder") / "ladder"
    build_ladder(DEFAULT_CHECKPOINT, directory, BuildConfig(progress=False))
    return directory


@pytest.fixture(scope="session")
def default_ladder(default_ladder_dir: Path) -> Ladder:
    return load_ladder(default_ladder_dir)


@pytest.fixture(scope="session")
def tiny_ladder_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A real ladder built in seconds into a temporary directory: the unit and service tests run on it
    (tests/tiny_ladder.py). With ANYTIME_TEST_TINY_LADDER naming one that `python -m tests.tiny_ladder` built,
    the session copies that one instead of building (scripts/mutation.sh: one session per mutant)."""
    root = tmp_path_factory.mktemp("tiny-ladder")
    prebuilt = os.environ.get(TINY_LADDER_ENV)
    if prebuilt:
        if not (Path(prebuilt) / "ladder" / "ladder.json").is_file():
            raise pytest.UsageError(f"{TINY_LADDER_ENV}={prebuilt}: no ladder/ladder.json there")
        source, cached = Path(prebuilt), None
    else:
        from tests.tiny_ladder import cached_tiny_ladder  # imports torch: not for a session given a ladder

        source = cached = cached_tiny_ladder()
    if source is not None and (source / "ladder" / "ladder.json").is_file():
        shutil.copytree(source, root, dirs_exist_ok=True)  # a copy: a test may write into its ladder
        return root / "ladder"
    from tests.tiny_ladder import build_tiny_ladder, store

    ladder = build_tiny_ladder(root, request.getfixturevalue("fmnist"))
    if cached is not None:
        store(root, cached)
    return ladder


@pytest.fixture(scope="session")
def ladder_dir(tiny_ladder_dir: Path) -> Path:
    """The ladder the unit and service tests run on (end-to-end tests take `default_ladder_dir`)."""
    return tiny_ladder_dir


@pytest.fixture(scope="session")
def ladder(ladder_dir: Path) -> Ladder:
    return load_ladder(ladder_dir)


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    """A client of the `server` fixture that a module running a real server defines."""
    with httpx.Client(base_url=server, timeout=30) as c:
        yield c


def last_exit(ladder: Ladder, precision: str = "fp32") -> Rung:
    """The ladder's last exit in `precision` on ONNX Runtime (every ladder has one)."""
    exits = [r for r in ladder.rungs if r.kind == "exit" and r.precision == precision and r.backend == "onnxruntime"]
    return max(exits, key=lambda r: r.exit)
