"""The build's steps on small, substituted inputs: the probe's rule, the profiling stop rule, the ensemble
search and the step cache."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from engines.backends.onnxruntime import OnnxRuntimeEngine
from engines.base import Backend, EngineBase, Precision
from engines.manifest import Artifact, LatencyProfile, Probe, Rung
from engines.steps.cache import StepCache
from engines.steps.cuts import removal_accuracies, val_accuracy
from engines.steps.ensembles import dominated_by_estimate, forward_selection
from engines.steps.evaluate import Background
from engines.steps.export import _uneven_adaptive_pool, export_graph
from engines.steps.measure import ProfileConfig, measure_latency, p99_stable, profile_from_rounds, time_interleaved
from engines.steps.probe import built_precisions, decide
from models.data import FashionMNIST
from models.preprocess import PreprocessSpec
from models.registry import create_model

# -- the probe ----------------------------------------------------------------------------------------------


def test_probe_rule_with_substituted_timings_builds_only_what_can_pay() -> None:
    """Timings and accuracies substituted for the probe's measurements (this CPU's pattern: FP16 slower)."""
    p50 = {Precision.FP32: 0.60, Precision.INT8: 0.19, Precision.BF16: 0.33, Precision.FP16: 0.64}
    val = {Precision.FP32: 0.9428, Precision.INT8: 0.9418, Precision.BF16: 0.9418}
    decisions = decide(p50, val, min_speedup=0.05)
    assert decisions[Precision.FP16][0] is False and "not faster than FP32" in decisions[Precision.FP16][1]
    assert decisions[Precision.BF16][0] is False and "INT8 dominates" in decisions[Precision.BF16][1]
    # More accurate than INT8 by more than a standard error (0.33 pp on 5,000 val images): BF16 can sit between
    # INT8 and FP32 on the front. Within it (3.5 images more) it is a tie, and INT8 dominates.
    assert decide(p50, {**val, Precision.BF16: 0.9460}, 0.05, val_images=5000)[Precision.BF16][0] is True
    tie = decide(p50, {**val, Precision.BF16: 0.9425}, 0.05, val_images=5000)[Precision.BF16]
    assert tie[0] is False and "within 1 standard error" in tie[1]
    assert decide(p50, {**val, Precision.BF16: 0.9425}, 0.05, val_images=5000, tie_se=0)[Precision.BF16][0] is True
    # Faster than INT8 too (a machine with fast BF16): pays whatever its accuracy.
    assert decide({**p50, Precision.BF16: 0.15}, val, 0.05)[Precision.BF16][0] is True
    # Faster than FP32 by less than the margin is not faster.
    assert decide({**p50, Precision.BF16: 0.59}, {**val, Precision.BF16: 0.95}, 0.05)[Precision.BF16][0] is False
    assert decisions[Precision.INT8][0] is True  # 0.19 vs 0.60 ms: VNNI's pattern


def test_probe_rule_leaves_out_int8_where_it_is_not_faster_than_fp32() -> None:
    """This AVX2 CPU's pattern (2026-11-25, exit 3): INT8 slower than FP32 at batch 1 on a quiet machine, 9 %
    faster with other work beside the probe: no INT8 rung can pay. Then BF16, if faster than FP32, pays with no
    INT8 to dominate it."""
    p50 = {Precision.FP32: 3.31, Precision.INT8: 3.55, Precision.BF16: 3.75, Precision.FP16: 3.95}
    val = {Precision.FP32: 0.9428, Precision.INT8: 0.9426}
    decisions = decide(p50, val, min_speedup=0.05, int8_min_speedup=0.2)
    assert decisions[Precision.INT8] == (False, "3.550 ms at batch 1 is 1.07x FP32's 3.310 ms (not 20% faster or more)")
    contended = {**p50, Precision.FP32: 4.322, Precision.INT8: 3.945}
    assert decide(contended, val, 0.05, 0.2)[Precision.INT8][0] is False
    assert decide({**p50, Precision.INT8: 2.6}, val, 0.05, 0.2)[Precision.INT8][0] is True  # 21 % faster
    assert decide({**p50, Precision.BF16: 2.0}, val, 0.05)[Precision.BF16][0] is True
    pays = {str(p): d[0] for p, d in decisions.items()}
    probe = Probe(graph="exit3", rule="", engines=[], pays=pays, reasons={}, built=[])
    assert built_precisions(probe, None) == [Precision.FP32]
    assert built_precisions(probe, (Precision.INT8,)) == [Precision.FP32, Precision.INT8]  # asked for: built


# -- the profiling stop rule ----------------------------------------------------------------------------------


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ScriptedEngine(EngineBase):
    """Each run advances the fake clock by the next scripted duration (seconds)."""

    backend, precision, input_name, output_names = Backend.ONNXRUNTIME, Precision.FP32, "input", ["logits"]
    input_shape = (1, 2, 2)

    def __init__(self, clock: _FakeClock, durations: np.ndarray) -> None:
        self.clock, self.durations, self.calls = clock, durations, 0

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        self.clock.now += float(self.durations[self.calls % len(self.durations)])
        self.calls += 1
        return [np.zeros((len(x), 10), np.float32)]


def _profile(durations: np.ndarray, config: ProfileConfig) -> LatencyProfile:
    clock = _FakeClock()
    return measure_latency(_ScriptedEngine(clock, durations), 1, config, clock=clock)


def test_profiling_stops_at_the_floor_when_the_p99_is_stable() -> None:
    config = ProfileConfig(min_runs=100, max_runs=1000, max_seconds=100.0, check_every=50, warmup=5)
    steady = 1e-3 * (1 + 0.01 * np.random.default_rng(0).random(5000))  # 1 ms +- 1 %
    profile = _profile(steady, config)
    assert profile.runs == config.min_runs
    assert 1.0 <= profile.p50_ms <= profile.p99_ms <= 1.01


def test_profiling_runs_on_while_the_tail_is_unstable_and_stops_at_the_cap() -> None:
    config = ProfileConfig(min_runs=100, max_runs=600, max_seconds=100.0, check_every=50, warmup=0)
    rng = np.random.default_rng(1)
    tail = 1e-3 * np.where(rng.random(5000) < 0.02, rng.uniform(2, 20, 5000), 1.0)  # 2 % of runs 2-20x slower
    assert not p99_stable(tail[:600] * 1e3, config.tolerance, config.resamples)
    profile = _profile(tail, config)
    assert profile.runs == config.max_runs


def test_profiling_stops_on_its_time_budget_between_floor_and_cap() -> None:
    config = ProfileConfig(min_runs=100, max_runs=1000, max_seconds=0.25, check_every=50, warmup=0)
    rng = np.random.default_rng(2)
    tail = 1e-3 * np.where(rng.random(5000) < 0.02, rng.uniform(2, 20, 5000), 1.0)
    profile = _profile(tail, config)
    # The first check (every 50 runs from the floor) after 0.25 s of timing.
    expected = next(n for n in range(100, 1001, 50) if tail[:n].sum() >= 0.25)
    assert config.min_runs < profile.runs == expected < config.max_runs


def test_fixed_profiles_take_exactly_their_runs() -> None:
    profile = _profile(np.full(10, 1e-3), ProfileConfig.fixed(37, warmup=0))
    assert profile.runs == 37


class _SlowSpellEngine(EngineBase):
    """Each run takes 1 ms on the fake clock, 2 ms while the machine's slow spell lasts."""

    backend, precision, input_name, output_names = Backend.ONNXRUNTIME, Precision.FP32, "input", ["logits"]
    input_shape = (1, 2, 2)

    def __init__(self, clock: _FakeClock, spell_s: tuple[float, float]) -> None:
        self.clock, self.spell_s = clock, spell_s

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        slow = self.spell_s[0] <= self.clock.now < self.spell_s[1]
        self.clock.now += 2e-3 if slow else 1e-3
        return [np.zeros((len(x), 10), np.float32)]


def test_interleaved_rounds_outvote_a_slow_spell_that_one_block_keeps() -> None:
    spell = (0.0, 0.2)  # the first 0.2 s: as long as 100 slow runs
    clock = _FakeClock()
    block = measure_latency(_SlowSpellEngine(clock, spell), 1, ProfileConfig.fixed(100, warmup=0), clock=clock)
    assert block.p50_ms == pytest.approx(2.0)  # timed in one block, the engine the spell fell on keeps it

    clock = _FakeClock()
    engines = {"a": _SlowSpellEngine(clock, spell), "b": _SlowSpellEngine(clock, spell)}
    rounds = time_interleaved(engines, 1, rounds=5, runs=100, warmup=0, clock=clock)
    assert [np.median(r) for r in rounds["a"]] == pytest.approx([2.0, 1.0, 1.0, 1.0, 1.0])  # a's first round only
    for name in engines:
        profile = profile_from_rounds(1, rounds[name])
        assert (profile.p50_ms, profile.p90_ms, profile.p99_ms) == pytest.approx((1.0, 1.0, 1.0))
        assert profile.runs == 500


# -- the ensemble search --------------------------------------------------------------------------------------

# Out-of-fold accuracies of a synthetic case: a and b are the best single bases, but the best set is c+d+b,
# reached only from c (c's best partner is d, then b); a+b is the best pair.
SCORES = {
    ("a", "b"): 0.930,
    ("a", "c"): 0.921,
    ("a", "d"): 0.922,
    ("b", "c"): 0.923,
    ("b", "d"): 0.924,
    ("c", "d"): 0.925,
    ("a", "b", "c"): 0.929,
    ("a", "b", "d"): 0.928,
    ("b", "c", "d"): 0.940,
    ("a", "c", "d"): 0.926,
    ("a", "b", "c", "d"): 0.935,
}
SINGLE = {"a": 0.920, "b": 0.919, "c": 0.910, "d": 0.905}


def test_greedy_search_from_the_best_base_stops_when_no_gain() -> None:
    calls: list[tuple[str, ...]] = []

    def score(s: tuple[str, ...]) -> float:
        calls.append(s)
        return SCORES[s]

    tried = forward_selection(list("abcd"), SINGLE, score, starts=["a"])
    # From a: the three pairs, a+b wins; then the two triples with a+b, neither gains: stop.
    assert list(tried) == [("a", "b"), ("a", "c"), ("a", "d"), ("a", "b", "c"), ("a", "b", "d")]
    assert calls == list(tried)  # each set scored once
    assert ("b", "c", "d") not in tried


def test_greedy_search_from_every_base_finds_the_set_a_single_start_misses() -> None:
    calls: list[tuple[str, ...]] = []

    def score(s: tuple[str, ...]) -> float:
        calls.append(s)
        return SCORES[s]

    tried = forward_selection(list("abcd"), SINGLE, score, starts=["a", "b", "c", "d"])
    assert max(tried, key=tried.__getitem__) == ("b", "c", "d")
    assert len(calls) == len(set(calls)) == len(tried)  # memoized: no set is fitted twice


def _rung(name: str, val: float, ms: float) -> Rung:
    return Rung(
        name=name,
        precision=Precision.INT8,
        backend=Backend.ONNXRUNTIME,
        artifact=Artifact(path=f"{name}.onnx", sha256="0", bytes=1),
        input_shape=[1, 4, 4],
        outputs=["logits"],
        profiles=[LatencyProfile(batch=b, p50_ms=ms * b, p90_ms=ms * b, p99_ms=ms * b, runs=100) for b in (1, 32)],
        macs=1,
        peak_memory_bytes=0,
        kind="member",
        exit=1,
        val_accuracy=val,
        test_accuracy=val,
    )


def test_sets_that_cannot_be_on_the_front_are_not_timed() -> None:
    rungs = {n: _rung(n, SINGLE[n], ms) for n, ms in zip("abcd", (0.1, 0.15, 0.3, 0.25), strict=True)}
    acc = {s: SCORES[s] for s in [("a", "b"), ("a", "c"), ("b", "c", "d"), ("a", "b", "c", "d")]}
    estimate = {s: {b: sum(rungs[m].profile(b).p50_ms for m in s) for b in (1, 32)} for s in acc}
    by = dominated_by_estimate(acc, estimate, list(rungs.values()))
    assert by[("a", "b")] is None and by[("b", "c", "d")] is None  # the best pair, the best set
    assert by[("a", "c")] == "a+b"  # a+b is more accurate and, by the estimate, faster
    assert by[("a", "b", "c", "d")] == "b+c+d"


# -- the step cache -------------------------------------------------------------------------------------------


def test_step_cache_skips_an_unchanged_step(tmp_path: Path) -> None:
    runs: list[str] = []

    def make(text: str) -> dict[str, str]:
        runs.append(text)
        (tmp_path / "out.txt").write_text(text)
        return {"wrote": text}

    key = {"input": "sha-of-input", "option": 1}
    cache = StepCache(tmp_path)
    assert cache.run("step", key, lambda: make("one"), [tmp_path / "out.txt"]) == {"wrote": "one"}
    again = StepCache(tmp_path)  # a new build reads the cache from disk
    assert again.run("step", key, lambda: make("two"), [tmp_path / "out.txt"]) == {"wrote": "one"}
    assert runs == ["one"] and again.skipped == ["step"] and again.ran == []
    # A changed key, or an output changed on disk, runs the step again.
    assert again.run("step", {**key, "option": 2}, lambda: make("three"), [tmp_path / "out.txt"]) == {"wrote": "three"}
    (tmp_path / "out.txt").write_text("edited by hand")
    assert StepCache(tmp_path).run("step", {**key, "option": 2}, lambda: make("four"), [tmp_path / "out.txt"]) == {
        "wrote": "four"
    }
    assert runs == ["one", "three", "four"]


def test_step_cache_of_an_older_format_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "build-cache.json").write_text('{"exit1.fp32.onnx": "abc"}')  # format 1: a digest per file
    cache = StepCache(tmp_path)
    assert cache.entries == {}
    assert cache.run("step", {"k": 1}, lambda: 5) == 5 and cache.ran == ["step"]


@pytest.mark.parametrize("batch", [1, 3])
def test_measure_latency_uses_the_engines_input_shape(batch: int) -> None:
    clock = _FakeClock()
    engine = _ScriptedEngine(clock, np.full(4, 1e-3))
    profile = measure_latency(engine, batch, ProfileConfig.fixed(10, warmup=2), clock=clock)
    assert profile.batch == batch and engine.calls == 12


# -- the converter's command line -----------------------------------------------------------------------------


def test_python_m_engines_build_takes_the_build_options() -> None:
    import argparse

    from engines.build import BuildConfig, add_build_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    args = parser.parse_args(["--out", "x", "--members", "--precisions", "bf16", "--quiet", "--runs", "300"])
    config = config_from_args(args)
    assert config.members == () and config.precisions == (Precision.BF16,) and not config.progress
    assert config_from_args(parser.parse_args(["--members", "none"])).members == ()  # as the GPU images pass it
    assert config.runs == 300 and config.profile().max_runs == 300 and config.profile().min_runs == 50
    defaults = config_from_args(parser.parse_args([]))
    assert defaults.runs == BuildConfig().runs and defaults.threads == BuildConfig().threads == 1
    assert config_from_args(parser.parse_args(["--all-precisions"])).precisions == tuple(Precision)
    with pytest.raises(SystemExit):
        parser.parse_args(["--precisions", "fp64"])


def test_python_m_engines_build_and_anytime_build_are_one_command() -> None:
    import subprocess
    import sys

    def options(argv: list[str]) -> list[str]:
        out = subprocess.run([*argv, "--help"], capture_output=True, text=True, check=True).stdout
        return sorted(set(re.findall(r"--[a-z][a-z-]+", out)))

    module = options([sys.executable, "-m", "engines.build"])
    assert {"--precisions", "--all-precisions", "--members", "--runs", "--out"} <= set(module)
    assert module == options([str(Path(sys.executable).parent / "anytime"), "build"])


@pytest.mark.parametrize(
    ("cpuinfo", "saturates"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n", True),  # AVX2 only: VPMADDUBSW saturates
        ("processor\t: 0\nflags\t\t: avx2 avx512f avx512bw\n", True),  # AVX-512 without VNNI: the same
        ("processor\t: 0\nflags\t\t: avx2 avx512f avx512_vnni\n", False),
        ("processor\t: 0\nflags\t\t: avx2 avx_vnni\n", False),
        ("processor\t: 0\nFeatures\t: fp asimd asimddp\n", False),  # ARM: dot-product instructions
    ],
)
def test_int8_weights_are_7_bit_only_where_8_bit_ones_saturate(tmp_path: Path, cpuinfo: str, saturates: bool) -> None:
    from calibration.quantize import int8_saturates

    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert int8_saturates(path) is saturates
    assert int8_saturates(tmp_path / "absent") is False


# -- accuracy passes ----------------------------------------------------------------------------------------


def test_logits_by_another_route_stand_for_an_engine_s_only_when_it_gives_them(
    tiny_ladder_dir: Path, tmp_path: Path
) -> None:
    """`engine_logits(..., same_as=...)`, as the build takes an FP32 exit's logits from the stage chain: a route
    that agrees on the first SPOT_CHECK val images is taken whole (the marks after them come back: the engine did
    not run there); one that disagrees there is not, and the engine's own logits are computed."""
    import shutil

    from engines.build import BuildConfig, open_context
    from engines.steps.evaluate import SPOT_CHECK, engine_logits

    def logits(name: str, same_as: np.ndarray | None = None) -> np.ndarray:
        config = BuildConfig(members=(), progress=False)
        ctx = open_context(tiny_ladder_dir.parent / "resnet_exits_tiny.pt", tmp_path / name, config)
        path = shutil.copy(tiny_ladder_dir / "exit1.fp32.onnx", ctx.out / "exit1.fp32.onnx")
        route = None if same_as is None else (lambda split: same_as)
        return engine_logits(ctx, Path(path), Backend.ONNXRUNTIME, Precision.FP32, ("val",), 1, route)["val"]

    own = logits("own")
    marked = own.copy()
    marked[SPOT_CHECK:] += 1.0
    assert np.array_equal(logits("agrees", marked), marked)
    wrong = own.copy()
    wrong[SPOT_CHECK - 1] += 1.0
    assert np.array_equal(logits("disagrees", wrong), own)


# -- the cut search -----------------------------------------------------------------------------------------


def test_one_walk_scores_every_removal_as_a_forward_pass_per_cut_does(fmnist: FashionMNIST) -> None:
    """`removal_accuracies` runs the blocks before a candidate once per batch; each candidate's accuracy must be
    the one the whole network with that cut gives (random weights: the cuts' answers differ)."""
    torch.manual_seed(0)
    model = create_model("resnet_exits", widths=(8, 16, 32), blocks=(2, 2, 2), stem_stride=2).eval()
    with torch.no_grad():  # every block's last batch norm starts at zero (an identity block): wake them all
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    val = fmnist.split("val").head(600)
    spec = PreprocessSpec((1, 28, 28), "float32", (0.286,), (0.353,))
    for cut in [(), ("stage1.block2",), ("stage3.block2", "stage1.block2")]:
        candidates = [b for b in model.cuttable_blocks() if b not in cut]
        expected = {b: val_accuracy(model, val, spec, (*cut, b)) for b in candidates}
        assert removal_accuracies(model, val, spec, cut, candidates) == expected
        assert len(set(expected.values())) > 1


# -- export -----------------------------------------------------------------------------------------------------


class _Pooled(torch.nn.Module):
    def __init__(self, grid: int) -> None:
        super().__init__()
        self.conv, self.grid, self.fc = torch.nn.Conv2d(1, 4, 3, padding=1), grid, torch.nn.Linear(4 * grid * grid, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), self.grid)
        return self.fc(torch.flatten(pooled, 1))


def test_export_takes_the_torchscript_exporter_unless_a_pool_is_uneven(tmp_path: Path) -> None:
    """An uneven pool (4x4 of 14x14) goes to dynamo: the tiny ladder's exit 2 (tests/tiny_ladder.py) is exported
    that way and checked by the conformance tests. An even one goes to TorchScript, whose graph computes what
    torch computes (export_graph checks it to 1e-4) at any batch size."""
    example = torch.randn(2, 1, 14, 14)
    assert _uneven_adaptive_pool(_Pooled(4).eval(), example) and not _uneven_adaptive_pool(_Pooled(7).eval(), example)
    assert _uneven_adaptive_pool(torch.nn.AdaptiveMaxPool2d(4, return_indices=True), example)  # max: refused too
    assert not _uneven_adaptive_pool(torch.nn.AdaptiveMaxPool2d(7), example)
    module = _Pooled(7).eval()
    path = export_graph(module, (1, 14, 14), tmp_path / "pooled.onnx", ["logits"])
    assert "AveragePool" in {node.op_type for node in onnx.load(str(path)).graph.node}  # not dynamo's GatherND
    x = np.random.default_rng(0).standard_normal((5, 1, 14, 14)).astype(np.float32)
    engine = OnnxRuntimeEngine(path, Precision.FP32, threads=1)
    with torch.no_grad():
        assert np.allclose(engine.infer(x), module(torch.from_numpy(x)).numpy(), atol=1e-4)
    engine.close()


# -- background evaluations --------------------------------------------------------------------------------------


def test_the_waiting_thread_takes_queued_evaluations_and_a_task_error_reaches_it() -> None:
    """Substituted tasks (no engines): while the one worker is held by its task, `wait()` runs the queued ones
    in the calling thread instead of idling, then re-raises the first error."""
    ctx = SimpleNamespace(inputs=SimpleNamespace(split=lambda name: None))
    background = Background(ctx, workers=1)  # type: ignore[arg-type]
    started, release, ran_in = threading.Event(), threading.Event(), []
    background._submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)  # the worker holds the first task
    for _ in range(3):
        background._submit(lambda: ran_in.append(threading.current_thread().name))
    background._submit(release.set)
    background.wait()
    assert ran_in == [threading.current_thread().name] * 3

    failing = Background(ctx, workers=1)  # type: ignore[arg-type]
    failing._submit(lambda: (_ for _ in ()).throw(ValueError("bad logits")))
    with pytest.raises(ValueError, match="bad logits"):
        failing.wait()


# -- mirror views and per-image val records -------------------------------------------------------------------


def test_a_mirror_view_is_its_member_on_the_flipped_image(tiny_ladder_dir: Path, fmnist: FashionMNIST) -> None:
    """The tiny ladder's member (tests/tiny_ladder.py) gets a mirror view: a rung of its own, marked `mirror`,
    whose FP32 graph answers an image as the member's answers the image flipped left to right, and not as the
    member answers the image itself."""
    from engines.manifest import load_ladder

    ladder = load_ladder(tiny_ladder_dir)
    view = ladder.rung("vgg_tiny_mirror.fp32.onnxruntime")
    assert view.kind == "member" and view.mirror and not ladder.rung("vgg_tiny.fp32.onnxruntime").mirror
    x = PreprocessSpec.from_dict(ladder.preprocess).normalize(fmnist.split("val").images[:64]).astype(np.float32)
    member = OnnxRuntimeEngine(tiny_ladder_dir / "vgg_tiny.fp32.onnx", Precision.FP32, threads=1)
    mirror = OnnxRuntimeEngine(tiny_ladder_dir / "vgg_tiny_mirror.fp32.onnx", Precision.FP32, threads=1)
    try:
        np.testing.assert_allclose(mirror.infer(x), member.infer(np.ascontiguousarray(x[..., ::-1])), atol=1e-4)
        assert not np.allclose(mirror.infer(x), member.infer(x), atol=1e-2)
    finally:
        member.close()
        mirror.close()


def test_every_option_records_which_val_images_it_answers_right(tiny_ladder_dir: Path) -> None:
    """The planner's paired ties read these records (service/planner.py, Ties): each must agree with the
    accuracy recorded beside it, at every depth, out of fold for an ensemble."""
    from engines.manifest import load_ladder, unpack_right

    ladder = load_ladder(tiny_ladder_dir)
    images = ladder.split_sizes["val"]
    for record in [*ladder.rungs, *ladder.ensembles]:
        assert [unpack_right(r, images).mean() for r in record.val_right_by_depth] == pytest.approx(
            [record.val_accuracy], abs=1e-12
        ), record.name
    cascades = [*ladder.cascades, *ladder.member_cascades]
    assert cascades and ladder.ensembles
    for c in cascades:
        by_depth = [unpack_right(r, images).mean() for r in c.val_right_by_depth]
        assert by_depth == pytest.approx(c.val_accuracy_by_depth, abs=1e-12), c.name
