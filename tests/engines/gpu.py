"""The skips of the GPU tests, each with the reason that names what is missing: TensorRT, or a CUDA GPU.

Seen on a lent H200 (2026-11-26): CUDA and torch were there but TensorRT was not, and the old reason
("needs tensorrt and a CUDA GPU") did not say which of the two was missing."""

from __future__ import annotations

import importlib.util

import pytest


def cuda_missing() -> str | None:
    """Why the tests that need a CUDA GPU (through torch) cannot run here; None when they can."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    return None


def tensorrt_missing() -> str | None:
    """Why the TensorRT tests cannot run here; None when they can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (the gpu extra: pip install -e '.[gpu]' on an NVIDIA machine)"
    return cuda_missing()


_NO_CUDA = cuda_missing()
_NO_TENSORRT = tensorrt_missing()
needs_cuda = pytest.mark.skipif(_NO_CUDA is not None, reason=f"needs a CUDA GPU: {_NO_CUDA}")
needs_tensorrt = pytest.mark.skipif(_NO_TENSORRT is not None, reason=f"needs TensorRT on a CUDA GPU: {_NO_TENSORRT}")
