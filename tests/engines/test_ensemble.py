"""Ensemble rungs: the stacker round trip through skl2onnx, refusal of wrong stackers, end-to-end equality."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.backends.onnxruntime import OnnxRuntimeEngine
from engines.base import ArtifactError, Backend, Precision, sha256_file, softmax
from engines.ensemble import EnsembleEngine, StackerError, StackerKind, StackerSession, member_features, soft_vote
from engines.factory import open_ensemble
from engines.manifest import Artifact, Ensemble, LatencyProfile, Rung
from engines.steps.pareto import keep_pareto_ensembles
from engines.steps.stacker import candidate, export_stacker, fit_stacker

CLASSES, PIXELS = 10, 16


def _member_onnx(path: Path, seed: int) -> Path:
    """A tiny real member: flatten a 1x4x4 image, one dense layer to 10 logits (weights from `seed`)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((PIXELS, CLASSES)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["input"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "w"], ["logits"]),
        ],
        f"member{seed}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(path))
    return path


def _synthetic(n: int, members: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """Member logits that are noisy views of the labels, each member wrong in its own way."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    logits = []
    for _ in range(members):
        z = rng.standard_normal((n, CLASSES)).astype(np.float32) * 1.5
        z[np.arange(n), labels] += 1.2
        logits.append(z)
    return logits, labels


def _fitted(tmp_path: Path) -> tuple[Path, StackerKind, np.ndarray, object]:
    logits, labels = _synthetic(600, 2)
    features = member_features(logits)
    fit = fit_stacker(features, labels)
    return export_stacker(fit.estimator, features.shape[1], tmp_path / "stacker.onnx"), fit.kind, features, fit


def test_stacker_is_chosen_by_cross_validation_and_beats_one_member() -> None:
    logits, labels = _synthetic(600, 3)
    fit = fit_stacker(member_features(logits), labels)
    assert set(fit.cv_accuracy) == {"logistic_regression", "mlp"}
    assert fit.cv_accuracy[str(fit.kind)] == max(fit.cv_accuracy.values())
    assert fit.cv_accuracy[str(fit.kind)] == pytest.approx(float((fit.oof_predictions == labels).mean()))
    best_member = max(float((z.argmax(1) == labels).mean()) for z in logits)
    assert fit.cv_accuracy[str(fit.kind)] > best_member
    assert float((soft_vote(logits).argmax(1) == labels).mean()) > best_member


@pytest.mark.parametrize("kind", list(StackerKind))
def test_stacker_round_trip_gives_identical_predictions(tmp_path: Path, kind: StackerKind) -> None:
    logits, labels = _synthetic(400, 2, seed=1)
    features = member_features(logits)
    estimator = candidate(kind, 0).fit(features, labels)
    path = export_stacker(estimator, features.shape[1], tmp_path / f"{kind}.onnx")
    session = StackerSession(path, sha256_file(path), kind, features.shape[1], CLASSES)
    probs = session.predict_proba(features)
    np.testing.assert_allclose(probs, estimator.predict_proba(features), atol=1e-5)
    assert np.array_equal(probs.argmax(1), estimator.predict(features))
    again = StackerSession(path, sha256_file(path), kind, features.shape[1], CLASSES)  # reloaded from disk
    assert np.array_equal(again.predict_proba(features), probs)


def test_stacker_with_a_wrong_hash_is_refused(tmp_path: Path) -> None:
    path, kind, features, _ = _fitted(tmp_path)
    digest = sha256_file(path)
    with pytest.raises(ArtifactError, match="corrupt or was replaced"):
        StackerSession(path, "0" * 64, kind, features.shape[1], CLASSES)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupt or was replaced"):
        StackerSession(path, digest, kind, features.shape[1], CLASSES)


def test_stacker_of_a_wrong_type_is_refused(tmp_path: Path) -> None:
    path, kind, features, _ = _fitted(tmp_path)
    other = StackerKind.MLP if kind is StackerKind.LOGISTIC else StackerKind.LOGISTIC
    with pytest.raises(StackerError, match="no place in a"):
        StackerSession(path, sha256_file(path), other, features.shape[1], CLASSES)  # the other kind's graph
    with pytest.raises(StackerError, match="inputs"):
        StackerSession(path, sha256_file(path), kind, features.shape[1] + CLASSES, CLASSES)  # wrong member count
    network = _member_onnx(tmp_path / "not_a_stacker.onnx", 0)  # a valid ONNX file, but a network
    with pytest.raises(StackerError):
        StackerSession(network, sha256_file(network), kind, features.shape[1], CLASSES)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x80\x04not a protobuf")  # e.g. a pickle: never unpickled, refused
    with pytest.raises(StackerError, match="not an ONNX stacker"):
        StackerSession(garbage, sha256_file(garbage), kind, features.shape[1], CLASSES)


def test_ensemble_output_equals_the_stacker_on_its_members_outputs(tmp_path: Path) -> None:
    members = [_member_onnx(tmp_path / f"m{i}.onnx", i) for i in range(3)]
    rng = np.random.default_rng(5)
    x_val = rng.standard_normal((300, 1, 4, 4)).astype(np.float32)
    engines = [OnnxRuntimeEngine(p, Precision.FP32, threads=1) for p in members]
    member_logits = [e.infer(x_val) for e in engines]
    labels = np.stack(member_logits).sum(0).argmax(1)  # a target the members share, so the fit is not noise
    fit = fit_stacker(member_features(member_logits), labels)
    path = export_stacker(fit.estimator, 3 * CLASSES, tmp_path / "stacker.onnx")
    session = StackerSession(path, sha256_file(path), fit.kind, 3 * CLASSES, CLASSES)
    ensemble = EnsembleEngine(engines, session, Precision.FP32)
    in_turn = EnsembleEngine(engines, session, Precision.FP32, concurrent=False)  # members in the caller's thread

    x = rng.standard_normal((7, 1, 4, 4)).astype(np.float32)
    (log_probs,) = ensemble.run(x)
    np.testing.assert_array_equal(in_turn.run(x)[0], log_probs)
    separate = [OnnxRuntimeEngine(p, Precision.FP32, threads=1).infer(x) for p in members]
    expected = session.predict_proba(member_features(separate))
    np.testing.assert_allclose(softmax(log_probs), expected, atol=1e-6)
    np.testing.assert_allclose(softmax(log_probs), fit.estimator.predict_proba(member_features(separate)), atol=1e-5)
    assert ensemble.input_shape == (1, 4, 4) and ensemble.output_names == ["logits"]
    ensemble.close()


def _record(name: str, val: float, p50: float, **extra: object) -> dict[str, object]:
    return {
        "name": name,
        "precision": Precision.INT8,
        "backend": Backend.ONNXRUNTIME,
        "artifact": Artifact(path=f"{name}.onnx", sha256="0" * 64, bytes=1),
        "input_shape": [1, 4, 4],
        "outputs": ["logits"],
        "profiles": [LatencyProfile(batch=b, p50_ms=p50 * b, p90_ms=p50 * b, p99_ms=p50 * b, runs=1) for b in (1, 32)],
        "macs": 1,
        "peak_memory_bytes": 0,
        "val_accuracy": val,
        "test_accuracy": val,
        **extra,
    }


def _ensemble(name: str, members: list[str], val: float, p50: float) -> Ensemble:
    return Ensemble(
        **_record(name, val, p50),  # type: ignore[arg-type]
        members=members,
        stacker="logistic_regression",
        stacker_cv_accuracy={"logistic_regression": val, "mlp": val - 0.01},
        fit_split="val",
        fit_fingerprint="f",
        soft_vote_val_accuracy=val - 0.002,
        soft_vote_test_accuracy=val - 0.002,
    )


def test_builder_keeps_only_ensembles_on_the_front() -> None:
    a, b = Rung(**_record("a", 0.90, 1.0), kind="exit", exit=1), Rung(**_record("b", 0.92, 2.0), kind="exit", exit=3)
    pair = _ensemble("ens.pair", ["a", "b"], 0.93, 2.5)
    slow_pair = _ensemble("ens.slow", ["a", "b"], 0.925, 3.0)  # slower and less accurate than `pair`
    useless = _ensemble("ens.useless", ["a", "b"], 0.91, 2.1)  # `b` alone is faster and better
    kept, tried = keep_pareto_ensembles([a, b], [pair, slow_pair, useless])
    assert [e.name for e in kept] == ["ens.pair"] and not pair.dominated
    assert {t.name: t.kept for t in tried} == {"ens.pair": True, "ens.slow": False, "ens.useless": False}
    assert {t.name: t.dominated_by for t in tried}["ens.useless"] == "b"
    assert not a.dominated and not b.dominated


def test_open_ensemble_checks_every_file(tmp_path: Path) -> None:
    """A ladder's ensemble opens from its member rungs and stacker, each checked against its sha256."""
    members = [_member_onnx(tmp_path / f"m{i}.onnx", i) for i in range(2)]
    rungs = {
        f"m{i}": Rung(**{**_record(f"m{i}", 0.9, 1.0), "artifact": _art(p, tmp_path)}, kind="member", exit=1)  # type: ignore[arg-type]
        for i, p in enumerate(members)
    }
    path, kind, _, _ = _fitted(tmp_path)
    record = _ensemble("ens", ["m0", "m1"], 0.93, 2.0)
    record.artifact, record.stacker = _art(path, tmp_path), str(kind)  # type: ignore[assignment]
    engine = open_ensemble(tmp_path, record, rungs, CLASSES, threads=2)
    assert engine.run(np.zeros((2, 1, 4, 4), np.float32))[0].shape == (2, CLASSES)
    assert engine._pool is not None  # a thread for each member: side by side
    engine.close()
    engine = open_ensemble(tmp_path, record, rungs, CLASSES, threads=1)
    assert engine._pool is None  # one thread for two members: in turn
    engine.close()
    shutil.copy(members[1], members[0])  # a member replaced on disk
    with pytest.raises(ArtifactError):
        open_ensemble(tmp_path, record, rungs, CLASSES, threads=2)


def _art(path: Path, root: Path) -> Artifact:
    return Artifact(path=path.name, sha256=sha256_file(path), bytes=path.stat().st_size)
