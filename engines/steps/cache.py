"""The build's step cache: named steps keyed by content hashes, so an unchanged step is skipped.

Every step states a key: what its result is made from (input files by sha256, options, software versions,
the machine for timings). `build-cache.json` in the ladder directory keeps, per step, the digest of that
key, the step's JSON result and the files it wrote (path, sha256, size, mtime). A step is fresh when its
key's digest is the recorded one and every file it wrote is still on disk unchanged; a fresh step is not
run again and its result is returned as recorded (DVC's stages work the same way). Files are re-hashed only
when their size or mtime differ from the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from engines.base import sha256_file

FORMAT = 2  # build-cache.json of format 1 (one digest per file) is read as empty: every step runs once more
CACHE_NAME = "build-cache.json"
T = TypeVar("T")


def digest(key: Any) -> str:
    """A stable hash of a JSON-able key (dict order does not matter)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class StepCache:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / CACHE_NAME
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.entries: dict[str, dict[str, Any]] = data.get("steps", {}) if data.get("format") == FORMAT else {}
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.seconds: dict[str, float] = {}  # time spent running steps, by family (the name up to its first "/")
        self._hashes: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()  # evaluations run in background threads (engines/steps/evaluate.py)
        self._running: dict[str, threading.Lock] = {}  # one lock per step: a step asked for twice at once runs once

    def sha256(self, path: Path) -> str:
        """The file's sha256, computed once per (path, size, mtime) in this process."""
        st = path.stat()
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if memo not in self._hashes:
            self._hashes[memo] = sha256_file(path)
        return self._hashes[memo]

    def _file_record(self, path: Path) -> dict[str, Any]:
        st = path.stat()
        return {"sha256": self.sha256(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}

    def _unchanged(self, name: str, record: dict[str, Any]) -> bool:
        path = self.directory / name
        if not path.is_file():
            return False
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) == (record["bytes"], record["mtime_ns"]):
            # Known content: seed the memo so the manifest's sha256 costs nothing either.
            self._hashes[(str(path.resolve()), st.st_size, st.st_mtime_ns)] = record["sha256"]
            return True
        return self.sha256(path) == record["sha256"]

    def lookup(self, step: str, key: Any) -> tuple[bool, Any]:
        """(True, result) when `step` is fresh for `key`, else (False, None)."""
        entry = self.entries.get(step)
        if entry is None or entry["key"] != digest(key):
            return False, None
        if not all(self._unchanged(name, rec) for name, rec in entry["files"].items()):
            return False, None
        return True, entry["result"]

    def record(self, step: str, key: Any, result: Any, files: Sequence[Path] = ()) -> None:
        names = [str(Path(f).resolve().relative_to(self.directory.resolve())) for f in files]
        entry = {
            "key": digest(key),
            "result": result,
            "files": {name: self._file_record(self.directory / name) for name in names},
        }
        with self._lock:
            self.entries[step] = entry
            self._save()

    def run(self, step: str, key: Any, make: Callable[[], T], files: Sequence[Path] = ()) -> T:
        """`make()`'s JSON-able result, or the recorded one when `step` is fresh; `files` are what make() writes.

        A step another thread is running (the probe and a background evaluation may want the same logits) is
        waited for, then found fresh."""
        with self._lock:
            running = self._running.setdefault(step, threading.Lock())
        with running:
            fresh, result = self.lookup(step, key)
            if fresh:
                self.skipped.append(step)
                return result  # type: ignore[no-any-return]
            start = time.perf_counter()
            result = make()
            self.record(step, key, result, files)
        self.ran.append(step)
        family = step.split("/")[0]
        with self._lock:
            self.seconds[family] = self.seconds.get(family, 0.0) + time.perf_counter() - start
        return result

    def _save(self) -> None:
        # Atomic: an interrupted build leaves the previous cache, never half of one.
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "steps": self.entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
