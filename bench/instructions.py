"""Instructions per request, counted by callgrind: the front door's cost without the machine's noise.

Wall-clock figures on a shared VM move by 2x within an hour (bench/frontdoor.py prints the machine's steadiness
beside them); a change of a few percent in the request path drowns in that. Instructions do not move: valgrind's
callgrind counts each user-space instruction a process executes, the same count for the same work whatever else
the machine is doing. Each process below runs under callgrind (its threads one at a time, many times slower, which
stretches its time but not its count) and gets requests from one keep-alive client here: a warm-up, then
`--repeats` times: its counters zeroed, `--requests` requests, its counters dumped. A figure is the least over the
repeats of instructions / requests, and its breakdown that window's: what runs beside the requests only adds (a
thread of ONNX Runtime's that works in bursts, a full garbage collection, a thread pool starting). Here single
windows counted up to 38 % more than a process's least (the floor's, which runs no model, up to 268 %), mostly the
first two, after 30 warm-up requests or 100 alike. The spread (max - min, over min) is printed beside it.

The processes, on the fastest single INT8 rung (or `--rung`): the floor (a bare FastAPI constant endpoint), the
plain baseline and the lean reference (loadtest/baseline.py), Anytime fixed on the rung with a JSON/base64 body, a
PNG body and a uint8 tensor body, and the bare engine (ONNX Runtime's run on the same inputs, in a loop of its own
process). Printed: instructions per request; the request path (minus the bare engine's run) as ratios to the plain
server's and the lean reference's; and where the instructions go (self instructions by shared object: ONNX
Runtime, the Python interpreter, libc, zlib, ...), also as a plot.

What it does not count: the kernel (system calls, the loopback TCP stack, waking a thread) and the cycles lost to
cache misses and stalls, where much of a lone request's time goes (docs/measurements.md). Under valgrind, ONNX
Runtime and NumPy see the CPU that valgrind emulates (AVX2, no AVX-512), so the engine's own count is not a native
run's; it is the same engine in each process here. Needs valgrind (Debian: `apt-get install valgrind`); about 9
minutes here, most of it Anytime loading and warming its engines under valgrind.

    python -m bench.instructions [--ladder ladders/default] [--rung NAME] [--requests 100] [--repeats 5] \
        [--out reports/instructions] [--only floor,plain,lean,anytime,engine] [--against BEFORE.json]

A change to the request path, counted before and after (the code before from a git worktree, first on PYTHONPATH;
separate processes of the same code differ by up to 0.8 %, see `against`, so repeat each side for a small change):

    git worktree add /tmp/before HEAD~1
    PYTHONPATH=/tmp/before python -m bench.instructions --only anytime --out /tmp/before-counts
    python -m bench.instructions --only anytime --out /tmp/after-counts --against /tmp/before-counts/instructions.json
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.frontdoor import binary_requests, json_requests, pick_rungs
from engines.factory import open_engine
from engines.manifest import load_ladder
from loadtest.baseline import running_baseline
from loadtest.harness import png_base64, reap, running_server
from loadtest.http import BlockingConnection
from models.data import FashionMNIST, PreprocessSpec

Send = Callable[[int], None]  # makes request i (or runs the bare engine once) and checks its answer
WARMUP = 100  # requests before the first counted window (the first windows may still count more: see the docstring)
# Shared objects by what they do, in the order the table and the plot show them; the rest is "other".
GROUPS = (
    ("ONNX Runtime", ("onnxruntime",)),
    ("Python interpreter", ("libpython",)),
    ("C library", ("libc.so", "libm.so", "ld-linux", "libstdc++")),
    ("zlib (PNG)", ("libz.so",)),
    ("Pillow", ("_imaging",)),
    ("NumPy", ("_multiarray_umath",)),
    ("base64", ("binascii",)),
    ("orjson / pydantic-core", ("orjson", "_pydantic_core")),
    ("uvloop / httptools", ("uvloop", "loop.cpython", "parser.cpython", "url_parser")),
)


def group(shared_object: str) -> str:
    name = shared_object.rsplit("/", 1)[-1]
    return next((label for label, keys in GROUPS if any(k in name for k in keys)), "other")


def self_by_object(path: Path) -> Counter[str]:
    """Self instructions per shared object in a callgrind dump (`ob=` records; the cost line after a `calls=` line is
    a callee's inclusive cost and is skipped). Callgrind names an object once as `(id) name`, then `(id)` alone."""
    names: dict[str, str] = {}
    counts: Counter[str] = Counter()
    current, skip = "?", False
    with path.open() as f:
        for line in f:
            if skip:
                skip = False
                continue
            head = line[:1]
            if head.isdigit() or head in "+-*":
                fields = line.split()
                if len(fields) >= 2:
                    counts[current] += int(fields[1])
            elif line.startswith(("ob=", "cob=")):
                ref, _, name = line.split("=", 1)[1].strip().partition(" ")
                if name:
                    names[ref] = name
                if line.startswith("ob="):
                    current = names.get(ref, ref)
            elif line.startswith("calls="):
                skip = True
    return counts


def total(path: Path) -> int:
    """A dump's instructions: its last line, `totals:`, the sum of every self cost in it."""
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError(f"{path}: no totals line (an unfinished dump?)")


class Callgrind:
    """A process running under callgrind, its output in `folder`: zero its counters; dump and read them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.pid = 0

    @property
    def wrap(self) -> list[str]:
        out = self.folder / "callgrind.%p.out"
        return ["valgrind", "--tool=callgrind", "--dump-instr=no", f"--callgrind-out-file={out}"]

    def attach(self) -> None:
        """Find the process by its output file, which callgrind creates at start (it follows no child)."""
        (first,) = self.folder.glob("callgrind.*.out")
        self.pid = int(first.name.split(".")[1])

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "--zero", str(self.pid)], check=True, capture_output=True)

    def dump(self) -> Path:
        before = set(self.folder.glob(f"callgrind.{self.pid}.out.*"))
        subprocess.run(["callgrind_control", "--dump=measured", str(self.pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for path in set(self.folder.glob(f"callgrind.{self.pid}.out.*")) - before:
                try:
                    total(path)
                    return path
                except ValueError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"callgrind wrote no dump for process {self.pid}")


def count(cg: Callgrind, send: Send, n: int, repeats: int) -> dict[str, Any]:
    """`send(i)` makes request i; instructions per request over `repeats` windows of `n` requests."""
    for i in range(WARMUP):
        send(i)
    per_request: list[float] = []
    dumps: list[Path] = []
    for r in range(repeats):
        cg.zero()
        for i in range(n):
            send(WARMUP + r * n + i)
        dumps.append(cg.dump())
        per_request.append(total(dumps[-1]) / n)
    least = min(per_request)
    objects: Counter[str] = Counter()
    for name, ir in self_by_object(dumps[per_request.index(least)]).items():
        objects[group(name)] += ir
    return {
        "instructions": least,
        "spread": (max(per_request) - least) / least,
        "repeats": per_request,
        "by_object": {name: ir / n for name, ir in objects.most_common()},
    }


@contextmanager
def http_sender(url: str, requests: list[bytes]) -> Iterator[Send]:
    """One keep-alive connection that sends request i of `requests` (cycling) and checks it was answered 200."""
    conn = BlockingConnection(url, timeout_s=120)

    def send(i: int) -> None:
        response, _ = conn.send(requests[i % len(requests)])
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {response.body[:300]!r}")

    try:
        yield send
    finally:
        conn.close()


@contextmanager
def engine_loop(cg: Callgrind, ladder_dir: Path, rung: str) -> Iterator[Send]:
    """The bare engine in its own process under callgrind: it runs n times for each line `n` it reads, then says
    `done` (its stderr, valgrind's included, goes to `engine.log` beside the counts)."""
    argv = [*cg.wrap, sys.executable, "-m", "bench.instructions", "--engine-loop", rung, "--ladder", str(ladder_dir)]
    log = cg.folder / "engine.log"
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    try:
        if stdout.readline().strip() != "ready":
            raise RuntimeError(f"the engine loop did not start; see {log}")
        cg.attach()

        def send(_: int) -> None:
            stdin.write("1\n")
            stdin.flush()
            if stdout.readline().strip() != "done":
                raise RuntimeError(f"the engine loop stopped; see {log}")

        yield send
    finally:
        stdin.close()
        reap(proc, 60)


def serve_engine_loop(ladder_dir: Path, rung_name: str) -> None:
    ladder = load_ladder(ladder_dir)
    rung = next(r for r in ladder.rungs if r.name == rung_name)
    inputs = PreprocessSpec.from_dict(ladder.preprocess).normalize(FashionMNIST().split("test").images[:200])
    engine = open_engine(rung.backend, ladder_dir / rung.artifact.path, rung.precision, ladder.threads)
    print("ready", flush=True)
    i = 0
    for line in sys.stdin:
        for _ in range(int(line)):
            engine.run(inputs[i % len(inputs)][None])
            i += 1
        print("done", flush=True)


SERVERS = ("floor", "plain", "lean", "anytime", "engine")  # what --only may name


def measure(
    ladder_dir: Path, rung_name: str | None, n: int, repeats: int, out: Path, only: tuple[str, ...] = SERVERS
) -> dict[str, Any]:
    ladder = load_ladder(ladder_dir)
    rung = next(r for r in ladder.rungs if r.name == rung_name) if rung_name else pick_rungs(ladder)["fastest INT8"]
    images = FashionMNIST().split("test").images[:200]
    pngs = [png_base64(im) for im in images]
    fixed = {"deadline_ms": 60000, "policy": "fixed", "rung": rung.name}  # a deadline valgrind's pace cannot miss
    processes: dict[str, Any] = {}
    report: dict[str, Any] = {"rung": rung.name, "requests": n, "repeats": repeats, "processes": processes}

    def counted(label: str, cg: Callgrind, send: Send) -> None:
        processes[label] = count(cg, send, n, repeats)
        print(f"{label}: {processes[label]['instructions']:,.0f} instructions/request", flush=True)

    for label in [b for b in ("floor", "plain", "lean") if b in only]:
        cg = Callgrind(out / "callgrind" / label)
        floor, lean = label == "floor", label == "lean"
        with running_baseline(ladder_dir, rung.name, timeout_s=600, floor=floor, lean=lean, wrap=cg.wrap) as url:
            cg.attach()
            with http_sender(url, json_requests(url, pngs, deadline_ms=60000)) as send:
                counted(label, cg, send)
    if "anytime" in only:  # one server, each body form in turn
        cg = Callgrind(out / "callgrind" / "anytime")
        with running_server(ladder_dir, timeout_s=1800, wrap=cg.wrap, ANYTIME_WARMUP_RUNS="2") as url:
            cg.attach()
            bodies = {
                "anytime json": json_requests(url, pngs, **fixed),
                "anytime png": binary_requests(url, [base64.b64decode(p) for p in pngs], "image/png", **fixed),
                "anytime tensor": binary_requests(
                    url, [im.tobytes() for im in images], "application/x-tensor", dtype="uint8", shape="28,28", **fixed
                ),
            }
            for form, requests in bodies.items():
                with http_sender(url, requests) as send:
                    counted(form, cg, send)
    if "engine" in only:
        cg = Callgrind(out / "callgrind" / "engine")
        with engine_loop(cg, ladder_dir, rung.name) as send:
            counted("bare engine", cg, send)
    return report


def ratios(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each server's path (minus the bare engine) and its ratios to plain's and lean's, where those were counted."""
    p = report["processes"]
    if "bare engine" not in p:
        return {}
    engine = p["bare engine"]["instructions"]
    path = {k: v["instructions"] - engine for k, v in p.items() if k not in ("bare engine", "floor")}
    out: dict[str, dict[str, float]] = {k: {"path": v} for k, v in path.items()}
    for k, v in path.items():
        if "plain" in p:
            out[k]["total / plain"] = p[k]["instructions"] / p["plain"]["instructions"]
            out[k]["path / plain"] = v / path["plain"]
        if "lean" in p:
            out[k]["path / lean"] = v / path["lean"]
    return out


def against(report: dict[str, Any], before: dict[str, Any]) -> str:
    """Each process counted in both reports: its instructions before and now, and the difference. The same code
    counted in separate processes differed here by up to 0.8 % (Anytime JSON: 3,751,351 to 3,782,273 in five
    processes; mostly ONNX Runtime's bursting thread and the C library), so count a small change in several processes
    a side."""
    lines = [f"{'process':<16}{'before':>14}{'now':>14}{'difference':>14}"]
    for name, v in report["processes"].items():
        if name in before["processes"]:
            was, now = before["processes"][name]["instructions"], v["instructions"]
            lines.append(f"{name:<16}{was:>14,.0f}{now:>14,.0f}{now - was:>+14,.0f}{(now - was) / was:>+9.2%}")
    return "\n".join(lines)


def table(report: dict[str, Any]) -> str:
    p, r = report["processes"], report["ratios"]
    lines = [
        f"Instructions per request (user space, callgrind), rung {report['rung']}, least of {report['repeats']} "
        f"windows of {report['requests']} requests",
        f"{'process':<16}{'instructions':>14}{'spread':>8}{'minus engine':>14}{'/ plain':>9}{'path/plain':>12}"
        f"{'path/lean':>11}",
    ]
    for name, v in p.items():
        row = f"{name:<16}{v['instructions']:>14,.0f}{v['spread']:>8.2%}"
        if name in r:
            x = r[name]
            row += f"{x['path']:>14,.0f}"
            for key, width in (("total / plain", 8), ("path / plain", 11), ("path / lean", 10)):
                row += f"{x[key]:>{width}.2f}x" if key in x else " " * (width + 1)
        lines.append(row)
    labels = [g for g, _ in GROUPS] + ["other"]
    lines += ["", "Where they go (instructions per request, self, by shared object)"]
    lines.append(f"{'':<24}" + "".join(f"{n:>16}" for n in p))
    for g in labels:
        lines.append(f"{g:<24}" + "".join(f"{v['by_object'].get(g, 0):>16,.0f}" for v in p.values()))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = report["processes"]
    names = list(p)[::-1]
    labels = [g for g, _ in GROUPS] + ["other"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    left = [0.0] * len(names)
    for g in labels:
        widths = [p[n]["by_object"].get(g, 0) / 1e6 for n in names]
        ax.barh(names, widths, left=left, label=g)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("million instructions per request (user space, callgrind)")
    ax.set_title(f"Where a request's instructions go: {report['rung']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ladder", type=Path, default=Path("ladders/default"))
    parser.add_argument("--rung", help="the rung (default: the fastest single INT8 rung)")
    parser.add_argument("--requests", type=int, default=100, help="requests per counted window")
    parser.add_argument("--repeats", type=int, default=5, help="counted windows per process")
    parser.add_argument("--out", type=Path, default=Path("reports/instructions"))
    parser.add_argument(
        "--only", default=",".join(SERVERS), help=f"which to count, comma-separated, of {','.join(SERVERS)}"
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="BEFORE.json",
        help="an earlier run's instructions.json (e.g. of the code before a change, from a git worktree first on "
        "PYTHONPATH): print each process's difference from it",
    )
    parser.add_argument("--engine-loop", metavar="RUNG", help=argparse.SUPPRESS)  # the bare engine's own process
    args = parser.parse_args()
    if args.engine_loop:
        serve_engine_loop(args.ladder, args.engine_loop)
        return
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not found; install valgrind (Debian: apt-get install valgrind)")
    only = tuple(name.strip() for name in args.only.split(",") if name.strip())
    if not only or set(only) - set(SERVERS):
        parser.error(f"--only takes names of {', '.join(SERVERS)}; got {args.only!r}")
    before = json.loads(args.against.read_text()) if args.against else None
    if args.out.exists():
        shutil.rmtree(args.out / "callgrind", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = measure(args.ladder, args.rung, args.requests, args.repeats, args.out, only)
    report["ratios"] = ratios(report)
    (args.out / "instructions.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "instructions.png")
    print(table(report))
    if before is not None:
        print(f"\nAgainst {args.against}:\n{against(report, before)}")
    print(f"report: {args.out / 'instructions.json'}, plot: {args.out / 'instructions.png'}")


if __name__ == "__main__":
    main()
