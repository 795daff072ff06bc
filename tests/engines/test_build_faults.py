"""A build that cannot write: a full disk or a read-only directory gives a one-line error and leaves no new or
partial ladder.json (faults injected into the real build on the tiny ladder: the OSError a full disk or a
read-only mount raises, at the point where it would)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from cli.main import main
from engines.build import BuildConfig, build_ladder
from engines.manifest import MANIFEST_NAME, load_ladder
from engines.steps.graphs import BuildError
from tests.tiny_ladder import TINY_BUILD

pytestmark = pytest.mark.slow


def test_a_full_disk_at_the_manifest_leaves_the_previous_ladder_valid(
    tiny_ladder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ladder_dir = tmp_path / "ladder"
    shutil.copytree(tiny_ladder_dir, ladder_dir)
    before = (ladder_dir / MANIFEST_NAME).read_bytes()
    write_text = Path.write_text

    def full_disk(self: Path, *args: object, **kwargs: object) -> int:
        if self.name.endswith(".json.tmp"):
            write_text(self, "{ half a manif", encoding="utf-8")  # what a disk that filled up mid-write leaves
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", full_disk)
    member = tiny_ladder_dir.parent / "vgg_tiny.pt"
    with pytest.raises(BuildError, match=r"No space left on device.*no new ladder\.json was written"):
        build_ladder(
            tiny_ladder_dir.parent / "resnet_exits_tiny.pt", ladder_dir, BuildConfig(members=(member,), **TINY_BUILD)
        )  # type: ignore[arg-type]
    monkeypatch.undo()
    assert (ladder_dir / MANIFEST_NAME).read_bytes() == before
    assert not list(ladder_dir.glob("*.tmp"))  # no partial file left
    load_ladder(ladder_dir)  # the previous ladder, every file verified by sha256


def test_a_read_only_directory_is_one_line_and_exit_2(
    tiny_ladder_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ro" / "ladder"
    mkdir = Path.mkdir

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if self == out or out in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", read_only)
    checkpoint, member = tiny_ladder_dir.parent / "resnet_exits_tiny.pt", tiny_ladder_dir.parent / "vgg_tiny.pt"
    code = main(["build", str(checkpoint), "--members", str(member), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Read-only file system" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (out / MANIFEST_NAME).exists()
