from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engines.base import Precision
from engines.ensemble import StackerKind
from engines.manifest import Ladder, Rung, load_ladder
from models.checkpoint import DEFAULT_CHECKPOINT, Checkpoint, load_checkpoint
from models.data import FashionMNIST
from models.train import TrainConfig


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

    directory = tmp_path_factory.mktemp("default-ladder") / "ladder"
    build_ladder(DEFAULT_CHECKPOINT, directory, BuildConfig(progress=False))
    return directory


@pytest.fixture(scope="session")
def default_ladder(default_ladder_dir: Path) -> Ladder:
    return load_ladder(default_ladder_dir)


# The tiny ladder: a 3-exit ResNet of 8/16/32 channels and a 2-stage VGG member of 8/16, each trained for two
# epochs on 6,000 images, built with short profiles. Every step of the real build runs on real models (export,
# calibration, probe, measurement, cut search, thresholds, ensembles); only the sizes are small.
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


@pytest.fixture(scope="session")
def tiny_ladder_dir(tmp_path_factory: pytest.TempPathFactory, fmnist: FashionMNIST) -> Path:
    """A real ladder built in seconds into a temporary directory: the unit and service tests run on it."""
    from engines.build import BuildConfig, build_ladder
    from models.train import train_to

    root = tmp_path_factory.mktemp("tiny-ladder")
    main, member = root / "resnet_exits_tiny.pt", root / "vgg_tiny.pt"
    train_to(main, TINY_RESNET, fmnist, command="tests/conftest.py TINY_RESNET", progress=False)
    train_to(member, TINY_VGG, fmnist, command="tests/conftest.py TINY_VGG", progress=False)
    build_ladder(main, root / "ladder", BuildConfig(members=(member,), **TINY_BUILD))  # type: ignore[arg-type]
    return root / "ladder"


@pytest.fixture(scope="session")
def ladder_dir(tiny_ladder_dir: Path) -> Path:
    """The ladder the unit and service tests run on (end-to-end tests take `default_ladder_dir`)."""
    return tiny_ladder_dir


@pytest.fixture(scope="session")
def ladder(ladder_dir: Path) -> Ladder:
    return load_ladder(ladder_dir)


def last_exit(ladder: Ladder, precision: str = "fp32") -> Rung:
    """The ladder's last exit in `precision` on ONNX Runtime (every ladder has one)."""
    exits = [r for r in ladder.rungs if r.kind == "exit" and r.precision == precision and r.backend == "onnxruntime"]
    return max(exits, key=lambda r: r.exit)
