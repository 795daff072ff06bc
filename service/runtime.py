"""Everything a running service holds: the ladder, its engines (loaded and warmed), planner and scheduler."""

from __future__ import annotations

import gc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engines.base import Engine
from engines.factory import open_record
from engines.manifest import EngineRecord, Ladder, load_ladder
from models.preprocess import PreprocessSpec
from service.config import Settings
from service.metrics import Metrics
from service.planner import Planner
from service.predictor import LatencyPredictor
from service.scheduler import Scheduler

log = logging.getLogger("anytime.runtime")


class Runtime:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.ladder: Ladder = load_ladder(settings.ladder)  # checks every artefact's sha256
        self.threads = settings.threads or self.ladder.threads  # as the profiles were measured, by default
        self.ladder_json = self.ladder.model_dump_json().encode()  # GET /v1/ladder, serialized once
        self.spec = PreprocessSpec.from_dict(self.ladder.preprocess)
        self.records: dict[str, EngineRecord] = {
            r.name: r for r in [*self.ladder.stages, *self.ladder.rungs, *self.ladder.ensembles]
        }
        self.predictor = LatencyPredictor(list(self.records.values()), settings.observed_window)
        self.planner = Planner(self.ladder, self.predictor, settings.safety_margin_ms, settings.include_dominated)
        self.engines: dict[str, Engine] = {}
        self.scheduler = Scheduler(
            self.engines,
            self.planner,
            self.predictor,
            settings.max_queue,
            settings.max_batch,
            settings.safety_margin_ms,
            metrics,
            settings.inline_max_ms,
        )
        # Large images and bodies are decoded here, off the event loop (service/images.py says what is large).
        self.decoder = ThreadPoolExecutor(1, thread_name_prefix="anytime-decode")
        self.ready = threading.Event()
        self.failed: str | None = None
        self._closing = threading.Event()
        self._loader: threading.Thread | None = None

    def load_in_background(self) -> None:
        self._loader = threading.Thread(target=self.load, name="anytime-load", daemon=True)
        self._loader.start()

    def load(self) -> None:
        """Open and warm every engine, then start the worker; /readyz turns 200 only after this."""
        try:
            for name, record in self.records.items():
                if self._closing.is_set():  # shut down while loading: stop between engines
                    return
                engine = open_record(Path(self.settings.ladder), self.ladder, record, self.threads)
                engine.warmup((1, 8), runs=self.settings.warmup_runs)
                self.engines[name] = engine
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
