"""Property tests (hypothesis): the image decoder, the planner and the scheduler's queue, on generated inputs.

The decoder answers any input with a model input of the right shape or a BadImage, nothing else; a plan never
needs more than the time left it was given; a queue never loses a job, whatever is submitted and cancelled.
"""

from __future__ import annotations

import base64
import io
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from engines.manifest import Ladder
from models.preprocess import PreprocessSpec
from service.errors import ApiError, BadImage, DeadlineInfeasible
from service.images import open_item, open_plain_png, open_tensor, parse_shape, to_input
from service.planner import OnInfeasible, Option, Planner, Policy
from service.predictor import LatencyPredictor, _p90
from service.scheduler import Job
from tests.test_scheduler import _setup

SPEC = PreprocessSpec(input_shape=(1, 28, 28), dtype="float32", mean=(0.286,), std=(0.353,))  # Fashion-MNIST's
# A library loaded by the test session (onnxruntime or OpenVINO) turns on flush-to-zero, so subnormal floats
# cannot be made: every floats() strategy here says allow_subnormal=False.
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decodes_or_refuses(make) -> None:  # type: ignore[no-untyped-def]
    """`make()` opens an image; opening and decoding either give a (1, 1, 28, 28) finite input or BadImage."""
    try:
        pending = make()
        pendings = pending if isinstance(pending, list) else [pending]
        for p in pendings:
            x, resized = p.decode()
            assert x.shape == (1, *SPEC.input_shape) and x.dtype == np.float32 and np.isfinite(x).all()
            assert isinstance(resized, bool) and p.pixels >= 1
    except BadImage as e:
        assert e.status == 400 and e.message


@FAST
@given(st.binary(max_size=2048))
def test_any_bytes_as_base64_decode_or_are_bad_images(data: bytes) -> None:
    _decodes_or_refuses(lambda: open_item(base64.b64encode(data).decode(), SPEC))


@FAST
@given(st.text(max_size=300))
def test_any_text_decodes_or_is_a_bad_image(text: str) -> None:
    _decodes_or_refuses(lambda: open_item(text, SPEC))


_cells = st.one_of(
    st.integers(-5, 300), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), st.text(max_size=2)
)
_nested = st.recursive(st.lists(_cells, max_size=6), lambda inner: st.lists(inner, max_size=6), max_leaves=60)


@FAST
@given(_nested)
def test_any_nested_array_decodes_or_is_a_bad_image(pixels: list) -> None:  # type: ignore[type-arg]
    _decodes_or_refuses(lambda: open_item(pixels, SPEC))


@FAST
@given(
    st.integers(1, 64),
    st.integers(1, 64),
    st.sampled_from(["L", "RGB", "RGBA", "I;16", "P"]),
    st.sampled_from(["PNG", "JPEG"]),
    st.integers(0, 2**32 - 1),
)
def test_real_images_of_any_size_and_mode_decode(w: int, h: int, mode: str, fmt: str, seed: int) -> None:
    if fmt == "JPEG" and mode not in ("L", "RGB"):
        mode = "RGB"
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    pending = open_item(base64.b64encode(buf.getvalue()).decode(), SPEC)
    x, resized = pending.decode()
    assert x.shape == (1, 1, 28, 28) and np.isfinite(x).all() and resized == ((w, h) != (28, 28))


@FAST
@given(st.integers(1, 64), st.integers(1, 64), st.integers(0, 2**32 - 1), st.booleans())
def test_plain_png_path_gives_pils_pixels(w: int, h: int, seed: int, optimize: bool) -> None:
    """The fast path for 8-bit grey PNGs (service/images.py: open_plain_png) decodes exactly what PIL's full
    parser does, whatever row filters the encoder chose."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (h, w), dtype=np.uint8)
    if seed % 2:  # smooth images make the encoder pick Sub, Up, Average and Paeth rows
        pixels = np.cumsum(np.cumsum(pixels // 64, 0), 1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", optimize=optimize)
    pending = open_plain_png(buf.getvalue(), SPEC)
    assert pending is not None and pending.pixels == w * h
    x, resized = pending.decode()
    expected, expected_resized = to_input(Image.open(io.BytesIO(buf.getvalue())), SPEC)
    assert np.array_equal(x, expected) and resized == expected_resized


@FAST
@given(st.integers(0, 2**32 - 1), st.integers(0, 10_000), st.integers(1, 255), st.integers(0, 200))
@example(seed=0, where=35, flip=1, cut=0)  # IDAT's length one less: PIL's SyntaxError "broken PNG file"
def test_damaged_grey_pngs_decode_or_are_bad_images(seed: int, where: int, flip: int, cut: int) -> None:
    """A grey PNG with a byte changed and its tail cut off: a model input or BadImage, nothing else."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[where % len(data)] ^= flip
    _decodes_or_refuses(lambda: open_item(base64.b64encode(bytes(data[: len(data) - cut])).decode(), SPEC))


def test_an_undecodable_image_is_refused_in_words() -> None:
    """A truncated PNG was refused as "cannot decode the image: OSError" (or ValueError, or SyntaxError: the type
    depends on where the file stops, and says nothing of the cause)."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)).save(buf, "PNG")
    grey = buf.getvalue()
    at = grey.index(b"IDAT") - 4
    n = int.from_bytes(grey[at : at + 4], "big") // 2  # the image data cut in half, the chunks intact
    half = grey[:at] + n.to_bytes(4, "big") + grey[at + 4 : at + 8 + n] + bytes(4) + grey[-12:]
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (10, 200, 30)).save(buf, "PNG")
    colour = buf.getvalue()
    # The fast grey path (zlib) and PIL's own parser (a colour PNG), each stopping in the image data or its header.
    for data in (half, grey[:100], colour[:60], colour[: colour.index(b"IDAT") + 6]):
        with pytest.raises(BadImage) as e:
            open_item(base64.b64encode(data).decode(), SPEC).decode()
        assert e.value.message.startswith("cannot decode the image: the file is truncated or corrupt ("), data


@FAST
@given(
    st.binary(max_size=4096),
    st.sampled_from(["uint8", "float32", "int64", ""]),
    st.text(alphabet="0123456789,-x ", max_size=12),
    st.booleans(),
)
def test_any_tensor_body_decodes_or_is_a_bad_image(data: bytes, dtype: str, shape: str, batch: bool) -> None:
    _decodes_or_refuses(lambda: open_tensor(data, dtype, parse_shape(shape), SPEC, batch))


# -- the planner ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_names(ladder: Ladder) -> list[str]:
    return [r.name for r in [*ladder.stages, *ladder.rungs, *ladder.ensembles]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    policy=st.sampled_from([Policy.AUTO, Policy.STATIC, Policy.CASCADE, Policy.FIXED]),
    time_left=st.floats(0, 200, allow_subnormal=False),
    wait=st.floats(0, 100, allow_subnormal=False),
    margin=st.floats(0, 2, allow_subnormal=False),
    slowdown=st.floats(0.2, 20, allow_subnormal=False),
    pick=st.integers(0, 10**6),
    failed=st.integers(0, 10**6),
)
def test_a_plan_never_needs_more_than_the_time_left(
    ladder: Ladder,
    engine_names: list[str],
    policy: Policy,
    time_left: float,
    wait: float,
    margin: float,
    slowdown: float,
    pick: int,
    failed: int,
) -> None:
    """Feasible: queue wait + every step counted + margin fit in the time left; and no failed engine is used."""
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs, *ladder.ensembles], window=20)
    observed = engine_names[pick % len(engine_names)]  # the machine is slower (or faster) for one engine
    for _ in range(20):
        predictor.observe(observed, 1, predictor.predict(observed) * slowdown)
    planner = Planner(ladder, predictor, margin)
    out = engine_names[failed % len(engine_names)]
    planner.take_out(out)
    rung = sorted(planner.options)[pick % len(planner.options)] if policy is Policy.FIXED else None
    try:
        plan = planner.plan(policy, time_left, wait, OnInfeasible.REJECT, rung)
    except DeadlineInfeasible:
        fastest = min(predictor.predict(o.engines[0]) for o in planner.auto if out not in o.engines)
        assert policy is not Policy.AUTO or wait + fastest + margin > time_left  # auto refuses only when nothing fits
        return
    except ApiError as e:
        assert e.code == "out_of_service" and (policy is Policy.FIXED or policy is not Policy.AUTO)
        return
    assert plan.feasible and out not in plan.engines
    steps = [predictor.predict(e) for e in plan.engines]
    assert wait + steps[0] + margin <= time_left + 1e-9  # the first answer is in time
    if policy is Policy.STATIC:
        assert wait + sum(steps) + margin <= time_left + 1e-9
    # A cascade goes on to step k+1 only if that step still fits in what is left then.
    spent = wait + steps[0]
    for k in range(1, len(steps)):
        unsure = float("inf") if plan.kind == "stages" else -1.0
        goes_on = planner.continue_cascade(plan, k, unsure, time_left - spent + wait, wait)
        if goes_on:
            assert wait + steps[k] + margin <= time_left - spent + wait + 1e-9
        spent += steps[k]


def _weighed_afresh(planner: Planner, budget: float, cap: float) -> str | None:
    """auto's rule (Planner._best_within) worked out from the predictions as they stand, with nothing kept."""
    reachable, cheapest, least = [], None, float("inf")
    for option in planner.auto:
        elapsed, cost, depth = 0.0, 0.0, 0
        for reach, engine in zip(option.reach, option.engines, strict=True):
            t = planner.predictor.predict(engine)
            elapsed += t
            if elapsed > budget:
                break
            depth += 1
            cost += reach * planner.predictor.profiled_p50(engine)
        if depth and cost > cap:
            cheapest, least = (option, cost) if cost < least else (cheapest, least)
        elif depth:
            reachable.append((option.accuracy_by_depth[depth - 1], cost, option, depth))
    if not reachable:
        return None if cheapest is None else cheapest.name
    best, _, top, top_depth = max(reachable, key=lambda r: r[0])
    tied = [r for r in reachable if best - r[0] <= planner.ties.margin(best, (top.name, top_depth), (r[2].name, r[3]))]
    return min(tied, key=lambda r: (r[1], -r[0]))[2].name


_step = st.tuples(
    st.integers(0, 10**6),  # which engine runs (or none: an index past them)
    st.floats(0.2, 20, allow_subnormal=False),  # how much slower than its profile
    st.floats(0, 30, allow_subnormal=False),  # seconds that pass first (estimates go stale after 10)
    st.floats(0, 50, allow_subnormal=False),  # the budget, ms
    st.sampled_from([float("inf"), 0.05, 0.2, 0.5, 1.0, 3.0]),  # the load's cap, ms a request
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=200))  # ms; no subnormals (numpy warns of underflow)
def test_the_predictors_p90_is_numpys(values: list[float]) -> None:
    assert _p90(sorted(values)) == pytest.approx(float(np.percentile(values, 90)), rel=1e-12, abs=1e-12)


@given(st.lists(_step, min_size=1, max_size=60), st.sampled_from([0.0, 1.0, 2.0]))
def test_autos_remembered_choices_are_the_choices_weighed_afresh(
    ladder: Ladder, engine_names: list[str], steps: list[tuple[int, float, float, float, float]], tie_se: float
) -> None:
    """Whatever runs, however long passes, the choice auto keeps per fit is the one its rule makes from the
    predictions now; and the predictor's version changes whenever a prediction does."""
    clock = [1000.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "monotonic", lambda: clock[0])
        predictor = LatencyPredictor([*ladder.stages, *ladder.rungs, *ladder.ensembles], window=40)
        planner = Planner(ladder, predictor, 0.5, tie_se=tie_se)
        seen = (predictor.version, [predictor.predict(e) for e in engine_names])
        for pick, slowdown, wait_s, budget, cap in steps:
            clock[0] += wait_s
            if pick % (len(engine_names) + 1) < len(engine_names):
                engine = engine_names[pick % (len(engine_names) + 1)]
                for _ in range(10):  # an estimate is recomputed every 10th run
                    predictor.observe(engine, 1, predictor.prior(engine, 1, "p50") * slowdown)
            now = (predictor.version, [predictor.predict(e) for e in engine_names])
            assert now[1] == seen[1] or now[0] != seen[0], "a prediction changed, the version did not"
            seen = now
            chosen = planner._best_within(planner.auto, budget, cap, remember=True)
            assert (None if chosen is None else chosen.name) == _weighed_afresh(planner, budget, cap)


def test_autos_remembered_choice_follows_a_slower_engine(ladder: Ladder) -> None:
    """Once the engine of auto's choice runs so slowly that it no longer fits the budget, another option answers
    (the same budget, a new choice: what auto remembered is dropped with the predictions it was made on). The
    slowdown is derived from the choice's own predicted end, so it holds whatever the tiny ladder's accuracies and
    ties are on the machine that built it."""
    predictor = LatencyPredictor([*ladder.stages, *ladder.rungs, *ladder.ensembles])
    planner = Planner(ladder, predictor, 0.5, tie_se=2.0)

    def run(engine: str, slowdown: float) -> None:
        for _ in range(20):  # enough for an estimate of its own
            predictor.observe(engine, 1, predictor.prior(engine, 1, "p50") * slowdown)

    for engine in {e for option in planner.auto for e in option.engines}:
        run(engine, 1.0)
    first = planner._best_within(planner.auto, 50.0, float("inf"), remember=True)
    assert first is not None and len(first.engines) == 1

    def end(option: Option) -> float:  # its last step's predicted end (ms)
        return planner._steps(option, planner._table()[1])[0][-1]

    run(first.engines[0], max(20.0, 4 * 50.0 / end(first)))
    assert end(first) > 50.0
    second = planner._best_within(planner.auto, 50.0, float("inf"), remember=True)
    assert second is not None and second.name != first.name
    assert second.name == _weighed_afresh(planner, 50.0, float("inf"))


# -- the queue ------------------------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(
        st.just("submit"), st.sampled_from([Policy.CASCADE, Policy.STATIC]), st.floats(1, 200, allow_subnormal=False)
    ),
    st.tuples(st.just("cancel"), st.integers(0, 40), st.just(0.0)),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_op, min_size=1, max_size=40))
def test_the_queue_never_loses_a_job(ops: list[tuple[str, object, float]]) -> None:
    """Whatever is submitted, refused and cancelled, every accepted job is answered exactly once."""
    scheduler, planner, _ = _setup()
    scheduler.start()
    answered: dict[int, int] = {}
    lock = threading.Lock()
    accepted: list[Job] = []

    def done(job: Job) -> None:
        with lock:
            answered[id(job)] = answered.get(id(job), 0) + 1

    try:
        for kind, arg, deadline_ms in ops:
            if kind == "cancel":
                if accepted:
                    scheduler.cancel(accepted[int(arg) % len(accepted)])  # type: ignore[call-overload]
                continue
            now = time.monotonic()
            try:
                plan = planner.plan(arg, deadline_ms, scheduler.wait_ms(now + deadline_ms / 1e3), OnInfeasible.REJECT)  # type: ignore[arg-type]
                job = Job(str(len(accepted)), now, now + deadline_ms / 1e3, np.zeros((1, 4), np.float32), plan, done)
                scheduler.submit(job)
            except ApiError as e:
                assert e.status in (429, 503)  # refused up front: never queued, never answered
                continue
            accepted.append(job)
        limit = time.monotonic() + 10
        while len(answered) < len(accepted) and time.monotonic() < limit:
            time.sleep(0.002)
    finally:
        scheduler.stop()
    assert len(answered) == len(accepted) and set(answered.values()) <= {1}
    assert scheduler.depth() == 0
    for job in accepted:
        assert (job.error is None) != (job.logits is None) or job.cancelled  # an answer or an error, not both
