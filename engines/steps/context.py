"""What every step is handed: the ladder directory and its step cache, the inputs, versions and progress output."""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from engines.manifest import Artifact
from engines.steps.cache import StepCache
from engines.steps.graphs import Inputs

T = TypeVar("T")


@dataclass
class BuildContext:
    out: Path
    cache: StepCache
    inputs: Inputs
    data: str  # the data source as named on the command line (worker processes open it again)
    threads: int  # intra-op threads of every latency measurement (what the server runs with)
    eval_threads: int  # threads for accuracy evaluation, which no latency measurement overlaps
    workers: int  # processes for export and calibration (never while anything is timed)
    progress: bool = True
    versions: dict[str, str] = field(default_factory=dict)

    def bar(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
        return tqdm(items, desc=desc, total=total, disable=not self.progress, leave=False)  # type: ignore[no-any-return]

    def log(self, message: str) -> None:
        if self.progress:
            tqdm.write(message)

    def artifact(self, path: Path) -> Artifact:
        """The manifest's record of a file in the ladder directory (sha256 from the cache's memo)."""
        return Artifact(
            path=str(path.resolve().relative_to(self.out.resolve())),
            sha256=self.cache.sha256(path),
            bytes=path.stat().st_size,
        )


def software_versions() -> dict[str, str]:
    """The versions every export, calibration and measurement depends on (part of their cache keys)."""
    import numpy as np
    import onnx
    import onnxruntime
    import openvino
    import torch

    return {
        "torch": str(torch.__version__),
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.get_version(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def default_workers() -> int:
    """One: on 2 vCPUs a process pool for export and calibration cost more than it saved (engines/steps/parallel.py)."""
    return 1


def machine_key() -> dict[str, Any]:
    """Timings are only reused on the machine that took them."""
    from engines.steps.measure import machine_info

    info = machine_info()
    return {"cpu": info["cpu"], "cores": info["cores"]}
