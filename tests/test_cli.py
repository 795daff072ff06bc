from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: anytime " + command in capsys.readouterr().out


def test_bad_arguments_exit_2_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "0", "--out", "x.pt"])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "--widths", "a,b", "--out", "x.pt"])
    assert e.value.code == 2


def test_unknown_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "nope", "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'nope'" in err


def test_missing_data_names_the_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--data", f"fashion-mnist:{tmp_path}", "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anytime train: error: missing") and "apt-get install dataset-fashion-mnist" in err
    assert main(["evaluate", str(tmp_path / "none.pt")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_entry_point_is_installed() -> None:
    exe = Path(sys.executable).parent / "anytime"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert "train" in out and "evaluate" in out


def test_cli_default_checkpoint_is_the_models_one() -> None:
    from cli.train import DEFAULT_CHECKPOINT as CLI_DEFAULT
    from models.checkpoint import DEFAULT_CHECKPOINT

    assert CLI_DEFAULT == DEFAULT_CHECKPOINT.resolve()


def test_serve_imports_no_torch() -> None:
    """Each subcommand imports only what it needs: the server needs neither torch nor the offline builder."""
    code = (
        "import sys; from cli.main import build_parser; build_parser('serve'); import service.app, service.server; "
        "print(sorted(m for m in ('torch', 'onnx', 'sklearn', 'engines.build') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unexpected_error_shows_its_traceback(tmp_path: Path) -> None:
    """A bug is not an expected error: it is not reduced to one line (expected ones are, with exit 2)."""
    code = (
        "import cli.serve, sys\n"
        "def broken(args): raise RuntimeError('a bug')\n"
        "cli.serve.run_serve = broken\n"
        "from cli.main import main\n"
        "sys.exit(main(['serve']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" in done.stderr and "RuntimeError: a bug" in done.stderr


def test_our_models_package_wins_after_onnxruntime_quantization(tmp_path: Path) -> None:
    """onnxruntime.transformers appends a dir with a `models` namespace package to sys.path."""
    code = "import onnxruntime.quantization, engines.build, models; print(models.list_models())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "resnet_exits.fmnist" in out.stdout
