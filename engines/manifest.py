"""The ladder manifest (`ladder.json`): a versioned pydantic schema, one record per rung and stage."""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.base import ArtifactError, Backend, Precision, verify_artifact

SCHEMA_VERSION = 1
MANIFEST_NAME = "ladder.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LatencyProfile(_Model):
    """Latency of one engine at one batch size, measured after warm-up with fixed threads."""

    batch: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    runs: int


class Artifact(_Model):
    path: str  # relative to the ladder directory
    sha256: str
    bytes: int


class PlanInfo(_Model):
    """What a TensorRT plan was built from and for: it runs only with this TensorRT version on this GPU model."""

    source: Artifact  # the ONNX file TensorRT parsed
    tensorrt_version: str
    cuda_version: str
    gpu_name: str
    compute_capability: str
    min_batch: int  # the optimisation profile: batches the plan takes, and the one its kernels were tuned for
    opt_batch: int
    max_batch: int
    int8: Literal["qdq", "entropy_calibrator"] | None = None  # how an INT8 plan was quantized
    latency_clock: Literal["cuda_events"] = "cuda_events"  # profiles: GPU time from copy in to copy out


class EngineRecord(_Model):
    """What one engine file is and what it measured; shared by rungs and cascade stages."""

    name: str
    precision: Precision
    backend: Backend
    artifact: Artifact
    input_shape: list[int]  # one item, without the batch axis
    outputs: list[str]
    profiles: list[LatencyProfile]
    macs: int
    peak_memory_bytes: int  # resident-set growth while loading the engine and running batch 32
    max_batch: int | None = None  # the largest batch the engine takes (the scheduler caps batches to it); None: any
    plan: PlanInfo | None = None  # TensorRT rungs and stages only

    def profile(self, batch: int) -> LatencyProfile:
        """The profile at `batch`, or the smallest measured batch above it (conservative)."""
        above = [p for p in self.profiles if p.batch >= batch]
        if not above:
            raise ValueError(f"{self.name} has no profile at batch {batch} or larger")
        return min(above, key=lambda p: p.batch)


class Rung(EngineRecord):
    """One way to answer: a fixed exit, a residual cut or an ensemble member, in one precision on one backend."""

    kind: Literal["exit", "cut", "member"]
    exit: int
    model: str | None = None  # a member's registered model name (exits and cuts are the ladder's `model`)
    mirror: bool = False  # a member's mirror view: the member run on the image flipped left to right
    cut: list[str] = Field(default_factory=list)
    val_accuracy: float
    test_accuracy: float
    # Which val images it answers right (`pack_right`), for paired comparisons; empty in older ladders.
    val_right_by_depth: list[str] = Field(default_factory=list)
    dominated: bool = False  # slower and no more accurate than another rung: skipped by default
    dominated_by: str | None = None


class Ensemble(EngineRecord):
    """Member rungs run concurrently, their probabilities combined by a stacker fitted on `fit_split`.

    The artifact is the stacker (ONNX from skl2onnx); the profiles time the whole ensemble end to end.
    """

    kind: Literal["ensemble"] = "ensemble"
    members: list[str]  # rung names, in the stacker's input order
    stacker: Literal["logistic_regression", "mlp"]
    stacker_cv_accuracy: dict[str, float]  # each candidate's out-of-fold accuracy on the fit split
    fit_split: str
    fit_fingerprint: str
    val_accuracy: float  # out-of-fold (cross-validated) on val: the stacker itself is fitted on val
    test_accuracy: float
    val_right_by_depth: list[str] = Field(default_factory=list)  # as a rung's, out of fold
    soft_vote_val_accuracy: float  # the baseline: mean of the members' probabilities
    soft_vote_test_accuracy: float
    dominated: bool = False
    dominated_by: str | None = None


class EnsembleTried(_Model):
    """One member set the ensemble search fitted; only ensembles on the accuracy/latency front are kept.

    `measured` False: the set was pruned before timing, because a rung or another set was at least as
    accurate and, by the estimate (the sum of the members' p50), no slower; `p50_ms_batch1` is then that
    estimate and `stacker` the logistic regression the search scores with.
    """

    name: str
    members: list[str]
    stacker: str
    val_accuracy: float
    test_accuracy: float
    soft_vote_test_accuracy: float
    p50_ms_batch1: float
    kept: bool
    dominated_by: str | None = None
    measured: bool = True


class ProbeEngine(_Model):
    """One engine of the probe graph: p50 at batch 1 (interleaved rounds) and, where it was needed, val accuracy."""

    name: str
    precision: Precision
    backend: Backend
    p50_ms_batch1: float
    runs: int
    val_accuracy: float | None = None


class Probe(_Model):
    """Which optional precisions can pay on this machine, decided on one representative graph."""

    graph: str
    rule: str
    engines: list[ProbeEngine]
    pays: dict[str, bool]  # precision -> can pay here
    reasons: dict[str, str]
    built: list[Precision]  # the precisions this ladder was built in (FP32 always)


class Stage(EngineRecord):
    """stage_k of the cascade: features_{k-1} -> (features_k, logits_k)."""

    index: int


class Cascade(_Model):
    """An anytime chain of stages in one precision/backend with its fitted entropy thresholds."""

    name: str
    precision: Precision
    backend: Backend
    stages: list[str]  # Stage names, in order
    thresholds: list[float]  # one per exit but the last: stop when entropy <= threshold
    accuracy_bound_pp: float
    expected_exit_share: list[float]  # on val
    expected_mean_ms: float  # from stage p50 at batch 1 and the exit shares
    val_accuracy: float
    test_accuracy: float
    test_last_exit_accuracy: float
    # val accuracy when the cascade may run at most j stages (j = 1..k): what a shorter deadline still buys.
    # Empty in ladders built before it was recorded; planners then count only the whole cascade.
    val_accuracy_by_depth: list[float] = Field(default_factory=list)
    val_right_by_depth: list[str] = Field(default_factory=list)  # as a rung's, at each depth


class MemberCascade(_Model):
    """A heterogeneous cascade: member rungs of different families run one after another.

    After member j the outputs so far are combined (member 1 alone; members 1..j by `combiners[j-2]`: the
    mean of their probabilities, or a logistic-regression stacker over them, `stackers[j-2]`) and the cascade
    stops when the combined answer's highest probability reaches `thresholds[j-1]`, or when the next member
    no longer fits the deadline: the answer is then the combination so far. Orders, combiners and
    thresholds are chosen on val; costs are measured end to end (members, combiners and gate) over the test
    split at batch 1.
    """

    kind: Literal["member_cascade"] = "member_cascade"
    name: str
    members: list[str]  # rung names, in the order they run
    combiners: list[Literal["soft_vote", "logistic_regression"]]  # one per prefix of 2.. members
    stackers: list[Artifact | None]  # the ONNX stacker of a logistic_regression combiner, None for soft_vote
    gate: Literal["max_probability"] = "max_probability"
    thresholds: list[float]  # after member j < k: stop when the combined answer's top probability >= this
    accuracy_bound_pp: float  # val accuracy lost against running every member, at most
    fit_split: str
    fit_fingerprint: str
    val_accuracy: float
    test_accuracy: float
    val_accuracy_by_depth: list[float]  # at most j members (j = 1..k)
    val_right_by_depth: list[str] = Field(default_factory=list)  # as a rung's, at each depth
    test_exit_share: list[float]  # share of test images answered after member j
    test_mean_ms: float  # measured: members, stackers and gate, batch 1, over the test split
    test_p99_ms: float
    dominated: bool = False
    dominated_by: str | None = None


class Calibration(_Model):
    method: str
    chosen_by: Literal["val_accuracy", "named"]
    samples: int
    split: str
    fingerprint: str
    val_accuracy_by_method: dict[str, float]


class CutSearch(_Model):
    """The greedy residual-cut search: each step's dropped block, val accuracy and estimated ms saved."""

    steps: list[dict[str, float | str]]
    kept: list[str]  # rung names on the Pareto front


class Ladder(_Model):
    schema_version: int = SCHEMA_VERSION
    created: str
    checkpoint: Artifact
    model: str
    network_config: dict[str, object]
    class_names: list[str]
    preprocess: dict[str, object]
    data_source: str
    splits: dict[str, str]  # split name -> fingerprint
    split_sizes: dict[str, int] = Field(default_factory=dict)  # split name -> images (val, test)
    threads: int
    measuring: dict[str, object]  # threads, batch sizes and timed runs behind every profile
    machine: dict[str, str]
    software: dict[str, str]
    calibration: Calibration
    cut_search: CutSearch
    stages: list[Stage]
    cascades: list[Cascade]
    rungs: list[Rung]
    ensembles: list[Ensemble] = Field(default_factory=list)
    ensemble_search: list[EnsembleTried] = Field(default_factory=list)
    member_cascades: list[MemberCascade] = Field(default_factory=list)
    tensorrt_sources: list[Artifact] = Field(default_factory=list)  # symmetric QDQ ONNX for TensorRT plans
    build_seconds: float = 0.0
    probe: Probe | None = None
    # Steps run and skipped (cached) by the last build, and seconds spent per step family.
    build_steps: dict[str, float] = Field(default_factory=dict)

    def rung(self, name: str) -> Rung:
        for r in self.rungs:
            if r.name == name:
                return r
        raise KeyError(name)

    def ensemble(self, name: str) -> Ensemble:
        for e in self.ensembles:
            if e.name == name:
                return e
        raise KeyError(name)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(self.model_dump_json(indent=2))
            tmp.replace(path)  # a reader never sees half a manifest
        finally:
            tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        return path


class ManifestError(RuntimeError):
    """A ladder directory whose manifest is missing, malformed or of another schema version."""


def accuracy_stderr(accuracy: float, images: int) -> float:
    """The standard error of an accuracy measured on `images` images, sqrt(p (1 - p) / n); 0 without images."""
    return math.sqrt(accuracy * (1.0 - accuracy) / images) if images > 0 else 0.0


def paired_stderrs(right: np.ndarray) -> np.ndarray:
    """For records of which images each option answers right (rows of a bool matrix, one per option, on the same
    images), the standard error of the difference between every two accuracies: sqrt(var(d) / n) with d = right_a -
    right_b per image, var(d) = the share of images they disagree on - (p_a - p_b)^2. Two options that agree on most
    images differ by far less noise than either accuracy's own standard error (`accuracy_stderr`), so a consistent
    loss is told apart."""
    r = np.asarray(right, np.float64)
    n = r.shape[1]
    if not n:
        return np.zeros((len(r), len(r)))
    hits = r.sum(axis=1)
    p = hits / n
    var = (hits[:, None] + hits[None, :] - 2 * (r @ r.T)) / n - (p[:, None] - p[None, :]) ** 2
    return np.sqrt(np.maximum(var, 0.0) / n)


def pack_right(right: np.ndarray) -> str:
    """Per image, answered right or not, packed eight to a byte, base64 (836 characters for 5,000 images)."""
    return base64.b64encode(np.packbits(np.asarray(right, bool)).tobytes()).decode("ascii")


def unpack_right(packed: str, images: int) -> np.ndarray:
    """`pack_right` undone: a bool array of `images` entries."""
    return np.unpackbits(np.frombuffer(base64.b64decode(packed), np.uint8), count=images).astype(bool)


def load_ladder(directory: Path, verify: bool = True) -> Ladder:
    """Read `ladder.json`; with `verify`, check every artefact's sha256 (a mismatch is an ArtifactError)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"no ladder manifest at {path}: build one with `anytime build`")
    try:
        ladder = Ladder.model_validate_json(path.read_text())
    except ValidationError as e:
        raise ManifestError(
            f"{path} is not a valid ladder manifest: {e.error_count()} errors, first: "
            f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
        ) from None
    if ladder.schema_version != SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema {ladder.schema_version}, this code reads {SCHEMA_VERSION}")
    if verify:
        for record in [*ladder.stages, *ladder.rungs, *ladder.ensembles]:
            verify_artifact(Path(directory) / record.artifact.path, record.artifact.sha256)
    return ladder


__all__ = ["ArtifactError", "Ensemble", "Ladder", "ManifestError", "load_ladder"]
