"""checkpoint -> ONNX graphs -> INT8/BF16/FP16 engines -> measured profiles -> `ladder.json`.

Every step's output is keyed by what it was made from (checkpoint sha256, graph, method, versions) in
`build-cache.json`; a re-run redoes only the steps whose key changed, and reuses the measurements of
engines whose file and measuring settings did not change.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnxconverter_common import float16
from tqdm import tqdm

from calibration.data import CalibrationSet
from calibration.quantize import CalibrationMethod, quantize_int8
from engines.base import Backend, Engine, Precision, sha256_file
from engines.ensemble import StackerKind, StackerSession, member_features
from engines.ensemble import soft_vote as soft_vote_probs
from engines.factory import open_engine, open_ensemble
from engines.manifest import (
    Artifact,
    Calibration,
    Cascade,
    CutSearch,
    EngineRecord,
    Ensemble,
    EnsembleTried,
    Ladder,
    LatencyProfile,
    Rung,
    Stage,
)
from engines.steps.cuts import greedy_cuts
from engines.steps.export import EXPORT_FORMAT, ExitGraph, StageGraph, export_graph, stage_input_shape
from engines.steps.measure import accuracy, machine_info, measure_latency, measure_peak_memory, predict_logits
from engines.steps.stacker import FOLDS, export_stacker, fit_stacker
from engines.steps.thresholds import fit_thresholds, simulate
from models.checkpoint import DEFAULT_CHECKPOINT, Checkpoint, load_checkpoint
from models.data import DataSource, open_source
from models.evaluate import count_macs

# (precision, backend, source file precision) for every engine that runs on this CPU.
CPU_ENGINES = [
    (Precision.FP32, Backend.ONNXRUNTIME, Precision.FP32),
    (Precision.INT8, Backend.ONNXRUNTIME, Precision.INT8),
    (Precision.BF16, Backend.OPENVINO, Precision.FP32),  # OpenVINO runs the FP32 file in BF16
    (Precision.FP16, Backend.ONNXRUNTIME, Precision.FP16),  # the GPU file, measured here honestly
]


# The ensemble members built beside the main checkpoint by default (committed; README says how they were trained).
DEFAULT_MEMBERS = (
    DEFAULT_CHECKPOINT.parent / "densenet_fmnist.pt",
    DEFAULT_CHECKPOINT.parent / "mobilenetv2_fmnist.pt",
    DEFAULT_CHECKPOINT.parent / "vgg_fmnist.pt",
)
KIND_ORDER = {"exit": 0, "cut": 1, "member": 2}


class BuildError(ValueError):
    """Build inputs that do not fit together (e.g. a member trained with other preprocessing)."""


@dataclass
class BuildConfig:
    # Intra-op threads per engine: what the server runs with (its default is the ladder's). One thread was
    # faster at batch 1 than two on our 2-vCPU machines (ONNX Runtime: exit 1 INT8 0.063 vs 0.080 ms) and
    # leaves the other core to the server's event loop; under load two threads per engine fought the loop.
    threads: int = 1
    calib_samples: int = 1000
    calib_method: CalibrationMethod | None = None  # None: the method with the best val accuracy
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    runs: int = 200
    accuracy_bound_pp: float = 0.5
    min_cuts: int = 3
    max_cut_drop_pp: float = 5.0  # a cut variant this far below the full network's val accuracy is never kept
    data: str = "fashion-mnist"
    progress: bool = True
    members: tuple[Path, ...] = DEFAULT_MEMBERS  # single-exit checkpoints for ensembles; () builds none
    int8_max_drop_pp: float = 1.0  # a member whose INT8 rung loses more val accuracy joins ensembles in FP32
    stacker_seed: int = 0

    def measuring_key(self) -> dict[str, Any]:
        return {"threads": self.threads, "batch_sizes": list(self.batch_sizes), "runs": self.runs}


@dataclass
class Graph:
    """One exported network: a cascade stage, a fixed exit, or a residual cut (answering at the last exit)."""

    name: str
    kind: str  # "stage" | "exit" | "cut" | "member"
    exit: int
    cut: tuple[str, ...] = ()
    item_shape: tuple[int, ...] = ()
    outputs: list[str] = field(default_factory=lambda: ["logits"])
    macs: int = 0
    source: str = ""  # a member's checkpoint sha256 (other graphs come from the main checkpoint)

    def file(self, precision: Precision, tensorrt: bool = False) -> str:
        return f"{self.name}.{precision}{'.trt' if tensorrt else ''}.onnx"


class ArtifactCache:
    """Remembers the key each file was made from; a file whose key changed is rebuilt."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "build-cache.json"
        self.entries: dict[str, str] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    @staticmethod
    def digest(key: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def fresh(self, path: Path, key: dict[str, Any]) -> bool:
        return path.is_file() and self.entries.get(path.name) == self.digest(key)

    def record(self, path: Path, key: dict[str, Any]) -> None:
        self.entries[path.name] = self.digest(key)
        self.path.write_text(json.dumps(self.entries, indent=1, sort_keys=True))


class MeasurementCache:
    """Profiles, peak memory and accuracies of every engine the build measured, by name and file sha256.

    Every engine is kept, also those the build then drops (cut variants off the FP32 front): a re-run
    reuses the same numbers and so makes the same choices. Entries are void when the measuring settings
    or the data splits change.
    """

    def __init__(self, directory: Path, key: dict[str, Any]) -> None:
        self.path = directory / "measurements.json"
        self.key = ArtifactCache.digest(key)
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.entries: dict[str, dict[str, Any]] = data.get("entries", {}) if data.get("key") == self.key else {}

    def get(self, name: str, sha256: str) -> dict[str, Any]:
        entry = self.entries.get(name, {})
        return entry if entry.get("sha256") == sha256 else {}

    def put(self, name: str, sha256: str, **values: Any) -> None:
        self.entries[name] = {**self.get(name, sha256), **values, "sha256": sha256}
        self.path.write_text(json.dumps({"key": self.key, "entries": self.entries}, indent=1, sort_keys=True))


class Builder:
    def __init__(self, checkpoint_path: Path, out: Path, config: BuildConfig) -> None:
        self.out, self.config = Path(out), config
        self.out.mkdir(parents=True, exist_ok=True)
        self.source: DataSource = open_source(config.data)
        self.ckpt: Checkpoint = load_checkpoint(checkpoint_path, self.source)
        self.ckpt_artifact = _artifact(Path(checkpoint_path), Path(checkpoint_path).resolve().parent)
        self.model = self.ckpt.build_model()
        self.spec = self.ckpt.preprocess
        self.cache = ArtifactCache(self.out)
        self.measured = MeasurementCache(self.out, {**config.measuring_key(), "splits": self.ckpt.splits})
        self.versions = {"torch": str(torch.__version__), "onnx": onnx.__version__, **_backend_versions()}
        self.val, self.test = self.source.split("val"), self.source.split("test")
        self.members = {p.stem: self._load_member(p) for p in config.members}
        torch.set_num_threads(config.threads)
        torch.set_flush_denormal(True)

    # -- helpers -------------------------------------------------------------------------------------
    def _load_member(self, path: Path) -> tuple[Checkpoint, Artifact, torch.nn.Module]:
        """A member checkpoint: checked against the data, and fed exactly the main model's input."""
        ckpt = load_checkpoint(path, self.source)
        model = ckpt.build_model()
        if getattr(model, "num_stages", 1) != 1:
            raise BuildError(f"member {path} has {model.num_stages} exits; members answer with one")
        if ckpt.preprocess != self.spec or ckpt.class_names != self.ckpt.class_names:
            raise BuildError(f"member {path} was trained with other preprocessing or classes than the main model")
        return ckpt, _artifact(Path(path), Path(path).resolve().parent), model

    def _key(self, **extra: Any) -> dict[str, Any]:
        return {"checkpoint": self.ckpt_artifact.sha256, "versions": self.versions, **extra}

    def _graph_key(self, g: Graph, **extra: Any) -> dict[str, Any]:
        """A member graph depends on its own checkpoint only, so retraining the main model keeps it."""
        graph = {k: v for k, v in asdict(g).items() if k != "source" or v}  # keys of older builds stay valid
        return {**self._key(graph=graph, **extra), "checkpoint": g.source or self.ckpt_artifact.sha256}

    def _bar(self, items: list[Any], desc: str) -> Any:
        return tqdm(items, desc=desc, disable=not self.config.progress)

    def _log(self, message: str) -> None:
        if self.config.progress:
            tqdm.write(message)

    def cut_search(self) -> list[dict[str, float | str]]:
        """The greedy path, reused while the checkpoint and data are unchanged (it depends on timings)."""
        path = self.out / "cut-search.json"
        key = self._key(step="cut-search", val=self.val.fingerprint)
        if self.cache.fresh(path, key):
            steps: list[dict[str, float | str]] = json.loads(path.read_text())
            return steps
        steps = greedy_cuts(self.model, self.val.head(2000), self.spec)
        path.write_text(json.dumps(steps, indent=1))
        self.cache.record(path, key)
        return steps

    # -- graphs ----------------------------------------------------------------------------------------
    def graphs(self, cuts: list[tuple[str, ...]]) -> list[Graph]:
        k_last = self.model.num_stages
        shape = tuple(self.spec.input_shape)
        graphs = [
            Graph(f"stage{k}", "stage", k, (), stage_input_shape(self.model, shape, k), ["features", "logits"])
            for k in range(1, k_last + 1)
        ]
        graphs += [Graph(f"exit{k}", "exit", k, (), shape) for k in range(1, k_last + 1)]
        graphs += [Graph(f"cut{i}", "cut", k_last, cut, shape) for i, cut in enumerate(cuts, 1)]
        for g in graphs:
            g.macs = count_macs(self.module(g), torch.zeros(1, *g.item_shape))
        return graphs

    def member_graphs(self) -> list[Graph]:
        shape = tuple(self.spec.input_shape)
        graphs = [Graph(name, "member", 1, (), shape, source=art.sha256) for name, (_, art, _) in self.members.items()]
        for g in graphs:
            g.macs = count_macs(self.module(g), torch.zeros(1, *shape))
        return graphs

    def module(self, g: Graph) -> torch.nn.Module:
        if g.kind == "member":
            return self.members[g.name][2]
        return StageGraph(self.model, g.exit) if g.kind == "stage" else ExitGraph(self.model, g.exit, g.cut)

    def export(self, graphs: list[Graph]) -> None:
        for g in self._bar(graphs, "export ONNX"):
            path = self.out / g.file(Precision.FP32)
            key = self._graph_key(g, step="export", format=EXPORT_FORMAT)
            if not self.cache.fresh(path, key):
                export_graph(self.module(g), g.item_shape, path, g.outputs)
                self.cache.record(path, key)
            fp16 = self.out / g.file(Precision.FP16)
            key16 = self._graph_key(g, step="fp16", source=sha256_file(path))
            if g.kind not in ("stage", "member") and not self.cache.fresh(fp16, key16):
                half = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
                onnx.save(half, str(fp16))
                self.cache.record(fp16, key16)

    # -- INT8 ------------------------------------------------------------------------------------------
    def stage_transform(self, k: int) -> Callable[[np.ndarray], np.ndarray] | None:
        """FP32 run of stages 1..k-1: what stage k receives."""
        if k == 1:
            return None
        engines = [
            open_engine(Backend.ONNXRUNTIME, self.out / f"stage{s}.fp32.onnx", Precision.FP32, self.config.threads)
            for s in range(1, k)
        ]

        def run(x: np.ndarray) -> np.ndarray:
            for e in engines:
                x = e.run(x)[0]
            return x

        return run

    def calibration_set(self, g: Graph) -> CalibrationSet:
        transform = self.stage_transform(g.exit) if g.kind == "stage" else None
        return CalibrationSet(self.source.split("calib"), self.spec, self.config.calib_samples, transform=transform)

    def quantize(self, g: Graph, method: CalibrationMethod, cpu_path: Path | None = None) -> Path:
        fp32 = self.out / g.file(Precision.FP32)
        cpu = cpu_path or self.out / g.file(Precision.INT8)
        trt = None if cpu_path else self.out / g.file(Precision.INT8, tensorrt=True)
        calib = self.calibration_set(g)
        key = self._graph_key(g, step="int8", source=sha256_file(fp32), method=str(method), calib=calib.record())
        if not (self.cache.fresh(cpu, key) and (trt is None or self.cache.fresh(trt, key))):
            cache_path = self.out / "calibration" / f"{g.name}.{method}.json"
            cache_path.parent.mkdir(exist_ok=True)
            cache_path.unlink(missing_ok=True)  # ranges are recomputed whenever the source graph changed
            quantize_int8(fp32, cpu, trt, calib, method, cache_path)
            self.cache.record(cpu, key)
            if trt is not None:
                self.cache.record(trt, key)
        return cpu

    def choose_method(self, last: Graph) -> Calibration:
        """Quantize the last exit with every method; keep the named one or the one best on val."""
        calib = self.calibration_set(last)
        by_method: dict[str, float] = {}
        methods = [self.config.calib_method] if self.config.calib_method else list(CalibrationMethod)
        for method in self._bar(methods, "calibration methods"):
            path = self.quantize(last, method, cpu_path=self.out / "calibration" / f"{last.name}.{method}.int8.onnx")
            engine = open_engine(Backend.ONNXRUNTIME, path, Precision.INT8, self.config.threads)
            by_method[str(method)] = accuracy(predict_logits(engine, self.val, self.spec), self.val.labels)
        best = max(by_method, key=lambda m: by_method[m])
        return Calibration(
            method=best,
            chosen_by="named" if self.config.calib_method else "val_accuracy",
            samples=self.config.calib_samples,
            split="calib",
            fingerprint=str(calib.record()["fingerprint"]),
            val_accuracy_by_method=by_method,
        )

    # -- measuring -------------------------------------------------------------------------------------
    def engine_record(
        self,
        g: Graph,
        precision: Precision,
        backend: Backend,
        file_precision: Precision,
    ) -> tuple[dict[str, Any], Engine]:
        path = self.out / g.file(file_precision)
        art = _artifact(path, self.out)
        name = f"{g.name}.{precision}.{backend}"
        known = self.measured.get(name, art.sha256)
        if "profiles" in known:
            engine = open_engine(backend, path, precision, self.config.threads)
            memory, profiles = known["peak_memory_bytes"], known["profiles"]
        else:
            engine, memory = measure_peak_memory(lambda: open_engine(backend, path, precision, self.config.threads))
            profiles = [measure_latency(engine, b, self.config.runs).model_dump() for b in self.config.batch_sizes]
            self.measured.put(name, art.sha256, profiles=profiles, peak_memory_bytes=memory)
        record = {
            "name": name,
            "precision": precision,
            "backend": backend,
            "artifact": art.model_dump(),
            "input_shape": list(g.item_shape),
            "outputs": g.outputs,
            "profiles": profiles,
            "macs": g.macs,
            "peak_memory_bytes": memory,
        }
        return record, engine

    def rung(self, g: Graph, precision: Precision, backend: Backend, file_precision: Precision) -> Rung:
        record, engine = self.engine_record(g, precision, backend, file_precision)
        known = self.measured.get(record["name"], record["artifact"]["sha256"])
        if "val_accuracy" in known:
            val_acc, test_acc = known["val_accuracy"], known["test_accuracy"]
        else:
            val_acc = accuracy(predict_logits(engine, self.val, self.spec), self.val.labels)
            test_acc = accuracy(predict_logits(engine, self.test, self.spec), self.test.labels)
            self.measured.put(
                record["name"], record["artifact"]["sha256"], val_accuracy=val_acc, test_accuracy=test_acc
            )
        engine.close()
        return Rung(
            **record,
            kind=g.kind if g.kind in ("cut", "member") else "exit",
            exit=g.exit,
            model=self.members[g.name][0].model_name if g.kind == "member" else None,
            cut=list(g.cut),
            val_accuracy=val_acc,
            test_accuracy=test_acc,
        )

    def cascade(
        self,
        stages: list[Graph],
        precision: Precision,
        backend: Backend,
        file_precision: Precision,
    ) -> tuple[list[Stage], Cascade]:
        records, engines = [], []
        for g in stages:
            record, engine = self.engine_record(g, precision, backend, file_precision)
            records.append(Stage(**record, index=g.exit))
            engines.append(engine)
        val_logits = _chain_logits(engines, self.val, self.spec)
        fit = fit_thresholds(
            val_logits, self.val.labels, [s.profile(1).p50_ms for s in records], self.config.accuracy_bound_pp
        )
        test_logits = _chain_logits(engines, self.test, self.spec)
        _, preds = simulate(test_logits, fit.thresholds)
        for e in engines:
            e.close()
        cascade = Cascade(
            name=f"cascade.{precision}.{backend}",
            precision=precision,
            backend=backend,
            stages=[r.name for r in records],
            thresholds=fit.thresholds,
            accuracy_bound_pp=self.config.accuracy_bound_pp,
            expected_exit_share=fit.exit_share,
            expected_mean_ms=fit.mean_cost_ms,
            val_accuracy=fit.accuracy,
            test_accuracy=float((preds == self.test.labels).mean()),
            test_last_exit_accuracy=accuracy(test_logits[-1], self.test.labels),
        )
        return records, cascade

    # -- ensembles -------------------------------------------------------------------------------------
    def ensemble_bases(self, rungs: list[Rung], last_exit: Graph) -> list[Rung]:
        """The main model's INT8 last exit and each member's INT8 rung; FP32 where INT8 lost too much on val."""
        by_name = {r.name: r for r in rungs}
        bases = []
        for graph in [last_exit.name, *self.members]:
            int8 = by_name[f"{graph}.{Precision.INT8}.{Backend.ONNXRUNTIME}"]
            fp32 = by_name[f"{graph}.{Precision.FP32}.{Backend.ONNXRUNTIME}"]
            drop_pp = (fp32.val_accuracy - int8.val_accuracy) * 100
            if drop_pp > self.config.int8_max_drop_pp:
                self._log(f"{graph}: INT8 loses {drop_pp:.2f} pp on val (> {self.config.int8_max_drop_pp}); FP32 joins")
            bases.append(fp32 if drop_pp > self.config.int8_max_drop_pp else int8)
        return bases

    def member_logits(self, rung: Rung) -> tuple[np.ndarray, np.ndarray]:
        """A member rung's val and test logits."""
        engine = open_engine(rung.backend, self.out / rung.artifact.path, rung.precision, self.config.threads)
        logits = predict_logits(engine, self.val, self.spec), predict_logits(engine, self.test, self.spec)
        engine.close()
        return logits

    def ensembles(self, rungs: list[Rung], last_exit: Graph) -> list[Ensemble]:
        """Every combination of two or more bases, each with its stacker fitted and measured end to end."""
        if not self.members:
            return []
        bases = self.ensemble_bases(rungs, last_exit)
        logits = {r.name: self.member_logits(r) for r in self._bar(bases, "member outputs")}
        combos = [list(c) for n in range(2, len(bases) + 1) for c in itertools.combinations(bases, n)]
        by_name = {r.name: r for r in rungs}
        return [self.ensemble(c, logits, by_name) for c in self._bar(combos, "fit and measure ensembles")]

    def stacker(self, name: str, members: list[Rung], features: np.ndarray) -> tuple[Path, dict[str, Any]]:
        """Fit (LR or MLP by CV on val) and export one stacker; reused while its members and val are unchanged."""
        path, report_path = self.out / f"{name}.stacker.onnx", self.out / f"{name}.stacker.json"
        key = {
            "step": "stacker",
            "members": [m.artifact.sha256 for m in members],
            "val": self.val.fingerprint,
            "seed": self.config.stacker_seed,
            "folds": FOLDS,
            "versions": {**self.versions, **_stacker_versions()},
        }
        if self.cache.fresh(path, key) and self.cache.fresh(report_path, key):
            report: dict[str, Any] = json.loads(report_path.read_text())
            return path, report
        fit = fit_stacker(features, self.val.labels, self.config.stacker_seed)
        export_stacker(fit.estimator, features.shape[1], path)
        report = {"kind": str(fit.kind), "cv_accuracy": fit.cv_accuracy}
        report_path.write_text(json.dumps(report, indent=1))
        self.cache.record(path, key)
        self.cache.record(report_path, key)
        return path, report

    def ensemble(
        self, members: list[Rung], logits: dict[str, tuple[np.ndarray, np.ndarray]], rungs: dict[str, Rung]
    ) -> Ensemble:
        precision = Precision.INT8 if all(m.precision is Precision.INT8 for m in members) else Precision.FP32
        name = "ensemble." + "+".join(m.name.split(".")[0] for m in members) + f".{precision}.{Backend.ONNXRUNTIME}"
        val_logits, test_logits = [logits[m.name][0] for m in members], [logits[m.name][1] for m in members]
        path, report = self.stacker(name, members, member_features(val_logits))
        kind, num_classes = StackerKind(report["kind"]), len(self.ckpt.class_names)
        session = StackerSession(path, None, kind, len(members) * num_classes, num_classes)
        record = Ensemble(
            name=name,
            precision=precision,
            backend=Backend.ONNXRUNTIME,
            artifact=_artifact(path, self.out),
            input_shape=members[0].input_shape,
            outputs=["logits"],
            profiles=[],
            macs=sum(m.macs for m in members),
            peak_memory_bytes=0,
            members=[m.name for m in members],
            stacker=str(kind),  # type: ignore[arg-type]
            stacker_cv_accuracy=report["cv_accuracy"],
            fit_split="val",
            fit_fingerprint=self.val.fingerprint,
            val_accuracy=report["cv_accuracy"][str(kind)],
            test_accuracy=accuracy(session.predict_proba(member_features(test_logits)), self.test.labels),
            soft_vote_val_accuracy=accuracy(soft_vote_probs(val_logits), self.val.labels),
            soft_vote_test_accuracy=accuracy(soft_vote_probs(test_logits), self.test.labels),
        )
        engine, record.peak_memory_bytes = measure_peak_memory(
            lambda: open_ensemble(self.out, record, rungs, num_classes, self.config.threads)
        )
        # Its timing depends on the stacker and every member file.
        sha = hashlib.sha256(" ".join([record.artifact.sha256, *(m.artifact.sha256 for m in members)]).encode())
        known = self.measured.get(name, sha.hexdigest())
        if "profiles" in known:
            record.profiles = [LatencyProfile(**p) for p in known["profiles"]]
        else:
            record.profiles = [measure_latency(engine, b, self.config.runs) for b in self.config.batch_sizes]
            self.measured.put(name, sha.hexdigest(), profiles=[p.model_dump() for p in record.profiles])
        engine.close()
        return record

    # -- the whole build -------------------------------------------------------------------------------
    def build(self) -> Ladder:
        start = time.perf_counter()
        self._log(f"greedy residual-cut search on val ({len(self.model.cuttable_blocks())} cuttable blocks)")
        steps = self.cut_search()
        cuts = [tuple(str(s["dropped"]) for s in steps[: i + 1]) for i in range(len(steps))]
        graphs = self.graphs(cuts)
        self.export(graphs)
        by_kind = {kind: [g for g in graphs if g.kind == kind] for kind in ("stage", "exit", "cut")}
        # Cut variants off the FP32 accuracy/latency front are dropped before any other engine is made.
        answering = by_kind["exit"] + by_kind["cut"]
        fp32 = [self.rung(g, *CPU_ENGINES[0]) for g in self._bar(answering, "measure FP32 rungs")]
        fp32, kept = _keep_pareto_cuts(fp32, self.config.min_cuts, self.config.max_cut_drop_pp)
        answering = [g for g in answering if g.kind == "exit" or g.name in kept]
        calibration = self.choose_method(by_kind["exit"][-1])
        method = CalibrationMethod(calibration.method)
        members = self.member_graphs()
        self.export(members)
        for g in self._bar(by_kind["stage"] + answering + members, "quantize INT8"):
            self.quantize(g, method)
        rungs = fp32 + [
            self.rung(g, *spec) for g in self._bar(answering, "measure other rungs") for spec in CPU_ENGINES[1:]
        ]
        # Members get the precisions ensembles use (FP32 and INT8), measured like any rung.
        rungs += [self.rung(g, *spec) for g in self._bar(members, "measure member rungs") for spec in CPU_ENGINES[:2]]
        rungs.sort(key=lambda r: (KIND_ORDER[r.kind], r.name))  # exits, then cuts, then members; by name
        ensembles, tried = _keep_pareto_ensembles(rungs, self.ensembles(rungs, by_kind["exit"][-1]))
        stages, cascades = [], []
        for spec in self._bar([s for s in CPU_ENGINES if s[0] is not Precision.FP16], "measure cascades"):
            recs, cascade = self.cascade(by_kind["stage"], *spec)
            stages += recs
            cascades.append(cascade)
        trt_sources = [
            _artifact(self.out / g.file(Precision.INT8, tensorrt=True), self.out)
            for g in by_kind["stage"] + answering + members
        ]
        ladder = Ladder(
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            checkpoint=self.ckpt_artifact,
            model=self.ckpt.model_name,
            network_config=self.ckpt.model_config,
            class_names=self.ckpt.class_names,
            preprocess=self.spec.to_dict(),
            data_source=self.source.source_id,
            splits=self.ckpt.splits,
            threads=self.config.threads,
            measuring=self.config.measuring_key(),
            machine=machine_info(),
            software={**self.versions, **(_stacker_versions() if ensembles else {})},
            calibration=calibration,
            cut_search=CutSearch(steps=steps, kept=kept),
            stages=stages,
            cascades=cascades,
            rungs=rungs,
            ensembles=ensembles,
            ensemble_search=tried,
            tensorrt_sources=trt_sources,
            build_seconds=time.perf_counter() - start,
        )
        ladder.save(self.out)
        return ladder


def _chain_logits(engines: list[Engine], split: Any, spec: Any, batch_size: int = 250) -> list[np.ndarray]:
    """Every exit's logits for a split, running the stage engines as the cascade does (features passed on)."""
    per_exit: list[list[np.ndarray]] = [[] for _ in engines]
    for images, _ in split.batches(batch_size):
        x = spec.normalize(images)
        for k, engine in enumerate(engines):
            x, logits = engine.run(x)
            per_exit[k].append(logits)
    return [np.concatenate(chunks) for chunks in per_exit]


def _keep_pareto_cuts(fp32: list[Rung], min_cuts: int, max_drop_pp: float) -> tuple[list[Rung], list[str]]:
    """Keep the cut variants on the accuracy/latency front of all FP32 rungs (at least `min_cuts` of them).

    Only variants within `max_drop_pp` of the full network's val accuracy are candidates: the deepest cuts
    are the fastest of all, so they sit on the front even when they answer no better than chance.
    """
    full = max(r.val_accuracy for r in fp32 if r.kind == "exit")
    cuts = sorted(
        (r for r in fp32 if r.kind == "cut" and r.val_accuracy >= full - max_drop_pp / 100),
        key=lambda r: -r.val_accuracy,
    )
    front = [c for c in cuts if not any(_dominates(o, c) for o in fp32 if o is not c)]
    keep = front if len(front) >= min_cuts else cuts[:min_cuts]
    graphs = {r.name.split(".")[0] for r in keep}
    return [r for r in fp32 if r.kind != "cut" or r.name.split(".")[0] in graphs], sorted(graphs)


def _keep_pareto_ensembles(rungs: list[Rung], ensembles: list[Ensemble]) -> tuple[list[Ensemble], list[EnsembleTried]]:
    """Keep the ensembles that no rung or other ensemble dominates; mark dominance over what is kept."""
    mark_dominated([*rungs, *ensembles])
    tried = [
        EnsembleTried(
            name=e.name,
            members=e.members,
            stacker=e.stacker,
            val_accuracy=e.val_accuracy,
            test_accuracy=e.test_accuracy,
            soft_vote_test_accuracy=e.soft_vote_test_accuracy,
            p50_ms_batch1=e.profile(1).p50_ms,
            kept=not e.dominated,
            dominated_by=e.dominated_by,
        )
        for e in ensembles
    ]
    kept = [e for e in ensembles if not e.dominated]
    mark_dominated([*rungs, *kept])  # so every dominated_by names a record in the ladder
    return kept, tried


def _dominates(a: Rung | Ensemble, b: Rung | Ensemble) -> bool:
    """a is at least as accurate on val and no slower (p50) at every measured batch size, and better somewhere."""
    faster = all(a.profile(p.batch).p50_ms <= p.p50_ms for p in b.profiles)
    strictly = a.val_accuracy > b.val_accuracy or any(a.profile(p.batch).p50_ms < p.p50_ms for p in b.profiles)
    return a.val_accuracy >= b.val_accuracy and faster and strictly


def mark_dominated(rungs: Sequence[Rung | Ensemble]) -> None:
    for r in rungs:
        better = [o for o in rungs if o is not r and _dominates(o, r)]
        r.dominated = bool(better)
        r.dominated_by = max(better, key=lambda o: o.val_accuracy).name if better else None


def _artifact(path: Path, root: Path) -> Artifact:
    return Artifact(
        path=str(path.resolve().relative_to(root.resolve())), sha256=sha256_file(path), bytes=path.stat().st_size
    )


def _backend_versions() -> dict[str, str]:
    import onnxruntime
    import openvino

    return {
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.get_version(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def _stacker_versions() -> dict[str, str]:
    import skl2onnx
    import sklearn

    return {"scikit-learn": sklearn.__version__, "skl2onnx": skl2onnx.__version__}


def build_ladder(checkpoint: Path, out: Path, config: BuildConfig | None = None) -> Ladder:
    return Builder(checkpoint, out, config or BuildConfig()).build()


__all__ = ["BuildConfig", "EngineRecord", "build_ladder"]
