from __future__ import annotations

import pytest
import torch

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
