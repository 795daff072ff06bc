"""The skip of every TensorRT test, with the reason that names what is missing: TensorRT, or a CUDA GPU.

Seen on a lent H200 (2026-11-26): CUDA and torch were there but TensorRT was not, and the old reason
("needs tensorrt and a CUDA GPU") did not say which of the two was missing."""

from __future__ import annotations

import importlib.util

import pytest


def tensorrt_missing() -> str | None:
    """Why the TensorRT tests cannot run here; None when they can."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (the gpu extra: pip install -e '.[gpu]' on an NVIDIA machine)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    return None


_MISSING = tensorrt_missing()
needs_tensorrt = pytest.mark.skipif(_MISSING is not None, reason=f"needs TensorRT on a CUDA GPU: {_MISSING}")
