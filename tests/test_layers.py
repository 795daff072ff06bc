"""The import contracts of pyproject.toml ([tool.importlinter]) hold: offline and runtime apart (DESIGN.md 10)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold() -> None:
    exe = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_server_imports_no_offline_code() -> None:
    code = (
        "import sys, service.app, service.server, service.runtime; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'sklearn', 'skl2onnx') "
        "or m.startswith('engines.steps') or m == 'engines.build'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
