"""Everything a running service holds: the ladder, its engines (loaded and warmed), planner and scheduler."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import io
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from PIL import Image

from engines.base import Engine
from engines.ensemble import StackerKind, StackerSession, member_features, soft_vote
from engines.factory import open_record
from engines.manifest import MANIFEST_NAME, EngineRecord, Ensemble, Ladder, MemberCascade, load_ladder
from models.preprocess import PreprocessSpec
from service.auth import ApiKey
from service.caution import Caution
from service.config import Settings
from service.errors import ApiError
from service.images import open_bytes
from service.load import Budget
from service.metrics import Metrics
from service.planner import Combiner, OnInfeasible, Planner, Policy
from service.predictor import LatencyPredictor
from service.scheduler import Scheduler
from service.timing import PathTime

log = logging.getLogger("anytime.runtime")


PER_IMAGE = {k: {"__all__": {"val_right_by_depth"}} for k in ("rungs", "ensembles", "cascades", "member_cascades")}


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.ladder: Ladder = load_ladder(settings.ladder)  # checks every artefact's sha256
        self.threads = settings.threads or self.ladder.threads  # as the profiles were measured, by default
        # GET /v1/ladder, serialized once; without the per-image val records (the planner's, kilobytes each).
        self.ladder_json = self.ladder.model_dump_json(exclude=PER_IMAGE).encode()
        # The ladder's version: its manifest's hash, in every answer (which build answered, across a fleet).
        self.ladder_version = hashlib.sha256((Path(settings.ladder) / MANIFEST_NAME).read_bytes()).hexdigest()[:12]
        key = settings.api_key.get_secret_value() if settings.api_key else None
        self.api_key = ApiKey(key, settings.api_key_metrics)
        self.spec = PreprocessSpec.from_dict(self.ladder.preprocess)
        self.records: dict[str, EngineRecord] = {
            r.name: r for r in [*self.ladder.stages, *self.ladder.rungs, *self.ladder.ensembles]
        }
        self.predictor = LatencyPredictor(list(self.records.values()), settings.observed_window)
        caution = Caution(slack_ms=settings.auto_caution_slack_ms) if settings.auto_caution else None
        budget = None
        if settings.auto_utilization > 0:
            restraint = Caution(slack_ms=settings.auto_caution_slack_ms) if settings.auto_load_restraint else None
            budget = Budget(settings.auto_utilization, restraint=restraint)
        self.planner = Planner(
            self.ladder,
            self.predictor,
            settings.safety_margin_ms,
            settings.include_dominated,
            caution,
            budget,
            settings.auto_tie_se,
            settings.auto_quick_fallback,
        )
        metrics.caution.set_function(lambda: self.planner.factor(Policy.AUTO))
        if budget is not None:
            metrics.arrivals.set_function(budget.rate.per_second)
            metrics.budget.set_function(budget.ms)
        # What plans allow for the request's own path (service/timing.py), by where the plan was made: in the
        # HTTP parser (binary bodies: the body is still to be read) or in the route (after parsing).
        self.paths = {"parser": PathTime(), "route": PathTime()}
        for where, path in self.paths.items():
            metrics.path.labels(where).set_function(partial(getattr, path, "ms"))
        # Only what a served plan runs is loaded at start; a dominated rung is loaded when a request names it.
        self.served = [e for e in self.records if e in {x for o in self.planner.auto for x in o.engines}]
        self.engines: dict[str, Engine] = {}
        self.combiners: dict[str, list[Combiner]] = {}
        self.scheduler = Scheduler(
            self.engines,
            self.planner,
            self.predictor,
            settings.max_queue,
            settings.max_batch,
            settings.safety_margin_ms,
            metrics,
            settings.inline_max_ms,
            self.combiners,
            {name: cap for name in self.records if (cap := self.batch_cap(name)) is not None},
        )
        self.planner.in_flight = self.scheduler.depth
        # Large images and bodies are decoded here, off the event loop (service/images.py says what is large).
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="anytime-decode")
        self.ready = threading.Event()
        self.in_flight = 0  # classify requests inside the app (service/routes/classify.py)
        metrics.in_flight.set_function(lambda: self.in_flight)
        self.failed: str | None = None
        self._closing = threading.Event()
        self._loader: threading.Thread | None = None
        self._loading: dict[str, asyncio.Future[None]] = {}  # dominated rungs being loaded on request

    def batch_cap(self, name: str) -> int | None:
        """The most items one run of an engine takes, from the manifest (an ensemble's: its members' least)."""
        record = self.records[name]
        if isinstance(record, Ensemble):
            caps = [c for m in record.members if (c := self.batch_cap(m)) is not None]
            return min(caps) if caps else record.max_batch
        return record.max_batch

    def load_in_background(self) -> None:
        self._loader = threading.Thread(target=self.load, name="anytime-load", daemon=True)
        self._loader.start()

    def load(self) -> None:
        """Open and warm every served engine, then start the worker; /readyz turns 200 only after this."""
        try:
            for name in self.served:
                if self._closing.is_set():  # shut down while loading: stop between engines
                    return
                self._open(name)
            for cascade in self.ladder.member_cascades:
                self.combiners[cascade.name] = [self._combiner(cascade, j) for j in range(2, len(cascade.members) + 1)]
            self._warm_request_path()
            # Everything loaded so far lives as long as the server: out of the collector's sight, a collection
            # scans only what requests allocate (a full one over the loaded modules took milliseconds).
            gc.collect()
            gc.freeze()
            self.scheduler.start()
            self.ready.set()
            log.info("ladder %s ready: %d engines", self.settings.ladder, len(self.engines))
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.exception("loading the ladder failed")

    def _warm_request_path(self) -> None:
        """Decode a PNG and a JPEG and plan once per policy, so that the first requests do not pay for first
        calls (measured on a fresh server before this: the first request's decode 1.05 ms and plan 0.28 ms,
        0.06 and 0.05 ms by the tenth)."""
        channels, height, width = self.spec.input_shape
        for fmt in ("PNG", "JPEG"):  # an image of the size and kind the ladder takes
            buf = io.BytesIO()
            Image.new("L" if channels == 1 else "RGB", (width, height)).save(buf, fmt)
            open_bytes(buf.getvalue(), self.spec).decode()
        for policy in (Policy.AUTO, Policy.STATIC, Policy.CASCADE):
            try:
                self.planner.plan(policy, 1000.0, 0.0, OnInfeasible.REJECT)
            except ApiError:  # a ladder with no option for this policy
                pass

    def _open(self, name: str) -> None:
        engine = open_record(Path(self.settings.ladder), self.ladder, self.records[name], self.threads)
        cap = self.batch_cap(name) or 8
        engine.warmup(tuple(sorted({1, min(8, cap)})), runs=self.settings.warmup_runs)
        self.engines[name] = engine

    def _combiner(self, cascade: MemberCascade, j: int) -> Combiner:
        """How a member cascade combines its first j members: the mean of their probabilities, or its stacker."""
        stacker = cascade.stackers[j - 2]
        if cascade.combiners[j - 2] == "soft_vote" or stacker is None:
            return lambda member_logits: soft_vote(list(member_logits))
        num_classes = len(self.ladder.class_names)
        session = StackerSession(
            Path(self.settings.ladder) / stacker.path,
            stacker.sha256,
            StackerKind.LOGISTIC,
            j * num_classes,
            num_classes,
        )
        return lambda member_logits: session.predict_proba(member_features(list(member_logits)))

    async def require(self, engines: list[str]) -> None:
        """Make sure a plan's engines are loaded: one that is not (a dominated rung a request names) is loaded
        now, off the event loop, and the request waits for it (requests for the same rung share the load)."""
        for name in engines:
            if name in self.engines:
                continue
            loading = self._loading.get(name)
            if loading is None:
                loop = asyncio.get_running_loop()
                loading = self._loading[name] = loop.run_in_executor(self.decoder, self._open, name)
            try:
                await loading
            finally:
                self._loading.pop(name, None)

    def close(self) -> None:
        # A loader still inside a backend call must finish it first: native threads torn down under it abort.
        self._closing.set()
        if self._loader is not None:
            self._loader.join()
        if self.ready.is_set():
            self.scheduler.stop()
        self.decoder.shutdown(wait=True)
        for engine in self.engines.values():
            engine.close()
