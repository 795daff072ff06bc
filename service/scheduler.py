"""One earliest-deadline-first queue per device, worked at stage granularity, with dynamic batching.

A job is one request. Each work item runs one engine (a rung, or one cascade stage); a cascade's next
stage goes back into the queue with the job's deadline, so an urgent request can overtake it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engines.base import Engine
from engines.thresholds import entropy
from service.errors import ApiError, DeadlineExpired, QueueFull
from service.planner import OnInfeasible, Plan, Planner, Policy
from service.predictor import LatencyPredictor

log = logging.getLogger("anytime.scheduler")


@dataclass
class Job:
    id: str
    arrival: float  # time.monotonic() when the request arrived
    deadline: float  # absolute, time.monotonic() clock
    x: np.ndarray  # (1, C, H, W)
    plan: Plan
    on_done: Callable[[Job], None]
    step: int = 0  # index of the next engine in plan.engines
    logits: np.ndarray | None = None  # the best answer so far
    entropy: float = float("nan")
    started: float | None = None  # when its first engine started
    finished: float | None = None
    batch_sizes: list[int] = field(default_factory=list)
    cancelled: bool = False
    error: ApiError | None = None

    @property
    def best_effort(self) -> bool:
        return not self.plan.feasible


class Scheduler:
    def __init__(
        self,
        engines: dict[str, Engine],
        planner: Planner,
        predictor: LatencyPredictor,
        max_queue: int,
        max_batch: int,
        batch_window_ms: float,
        margin_ms: float,
        metrics: object | None = None,
    ) -> None:
        self.engines, self.planner, self.predictor = engines, planner, predictor
        self.max_queue, self.max_batch = max_queue, max_batch
        self.window_s, self.margin_ms = batch_window_ms / 1e3, margin_ms
        self.metrics = metrics
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._busy_until = 0.0  # predicted end of the batch being run
        self._jobs = 0  # accepted jobs not yet finished
        self._last_submit = 0.0
        self._arrival_gap = float("inf")  # between the last two submissions, s
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="anytime-worker", daemon=True)

    # -- client side ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def wait_ms(self, deadline: float) -> float:
        """Predicted queueing delay for a job due at `deadline`: the running batch plus earlier-due items."""
        with self._cond:
            ahead = sum(self.predictor.predict(j.plan.engines[j.step]) for d, _, j in self._heap if d <= deadline)
            running = max(0.0, self._busy_until - time.monotonic()) * 1e3
        return running + ahead

    def depth(self) -> int:
        return self._jobs

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._jobs >= self.max_queue:
                raise QueueFull(
                    f"{self._jobs} requests in the queue (limit {self.max_queue}); retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._jobs += 1
            now = time.monotonic()
            self._arrival_gap, self._last_submit = now - self._last_submit, now
            heapq.heappush(self._heap, (job.deadline, next(self._seq), job))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: its queued work is dropped when the worker reaches it."""
        job.cancelled = True

    # -- worker side ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = self._take_batch()
            if batch:
                try:
                    self._run(batch)
                except Exception:  # a failing engine must not kill the worker; the jobs get a 500
                    log.exception("engine %s failed", batch[0].plan.engines[batch[0].step])
                    for job in batch:
                        job.error = ApiError("internal error while running the model")
                        job.error.status, job.error.code = 500, "internal_error"
                        self._finish(job)

    def _take_batch(self) -> list[Job]:
        """Pop the earliest-due runnable job and the queued jobs for the same engine that can share its run."""
        now = time.monotonic()
        while self._heap:
            _, _, head = heapq.heappop(self._heap)
            if head.cancelled:
                self._finish(head)
                continue
            if not head.best_effort and not self._fits_now(head, now):
                continue
            break
        else:
            return []
        engine = head.plan.engines[head.step]
        batch = [head]
        self._add_mates(batch, engine, now)
        # Wait for batch-mates only while requests arrive closer together than the window: at low rates
        # the wait would be pure added latency.
        if len(batch) == 1 and 0 < self._arrival_gap <= self.window_s:
            slack = (head.deadline - now) * 1e3 - self.predictor.predict(engine, 2) - self.margin_ms
            if slack > self.window_s * 1e3:
                self._cond.wait(self.window_s)  # let batch-mates arrive; releases the lock meanwhile
                self._add_mates(batch, engine, time.monotonic())
        self._busy_until = time.monotonic() + self.predictor.predict(engine, len(batch)) / 1e3
        return batch

    def _fits_now(self, job: Job, now: float) -> bool:
        """Can the job's next engine still finish by its deadline? If not, settle it without running late.

        Queueing can take longer than planned (earlier-due arrivals overtake). A cascade then answers with
        its best answer so far; a job with no answer yet moves to the most accurate plan that still fits,
        and gets 504 at once when none does.
        """
        time_left = (job.deadline - now) * 1e3
        if self.predictor.predict(job.plan.engines[job.step]) + self.margin_ms <= time_left:
            return True
        if job.logits is None:
            try:
                job.plan = self.planner.plan(job.plan.policy, time_left, 0.0, OnInfeasible.REJECT, job.plan.name)
                return True
            except ApiError:
                job.error = DeadlineExpired(f"{max(time_left, 0.0):.2f} ms were left after queueing: no rung fits")
        self._finish(job)
        return False

    def _add_mates(self, batch: list[Job], engine: str, now: float) -> None:
        mates = [e for e in self._heap if e[2].plan.engines[e[2].step] == engine and not e[2].cancelled]
        if not mates:
            return
        chosen = []
        for entry in sorted(mates):
            if len(batch) >= self.max_batch:
                break
            members = [*batch, entry[2]]
            ms = self.predictor.predict(engine, len(members)) + self.margin_ms
            if all(j.best_effort or now + ms / 1e3 <= j.deadline for j in members):
                batch.append(entry[2])
                chosen.append(entry)
        if chosen:
            ids = {id(e[2]) for e in chosen}
            self._heap = [e for e in self._heap if id(e[2]) not in ids]
            heapq.heapify(self._heap)

    def _run(self, batch: list[Job]) -> None:
        for job in [j for j in batch if j.cancelled]:  # the client left while the batch was formed
            batch.remove(job)
            self._finish(job)
        if not batch:
            return
        head = batch[0]
        name = head.plan.engines[head.step]
        x = np.concatenate([j.x for j in batch])
        start = time.monotonic()
        for j in batch:
            j.started = j.started or start
        outputs = self.engines[name].run(x)
        ms = (time.monotonic() - start) * 1e3
        error = self.predictor.observe(name, len(batch), ms)
        if self.metrics is not None:
            self.metrics.observe_batch(name, len(batch), error)  # type: ignore[attr-defined]
        logits = outputs[-1]
        now = time.monotonic()
        for i, job in enumerate(batch):
            job.step += 1
            job.batch_sizes.append(len(batch))
            job.logits = logits[i : i + 1]
            job.entropy = float(entropy(job.logits)[0])
            if job.plan.policy is Policy.CASCADE and self._go_on(job, outputs[0][i : i + 1], now):
                with self._cond:
                    heapq.heappush(self._heap, (job.deadline, next(self._seq), job))
            else:
                self._finish(job)

    def _go_on(self, job: Job, features: np.ndarray, now: float) -> bool:
        if job.cancelled:
            return False
        time_left = (job.deadline - now) * 1e3
        go = self.planner.continue_cascade(job.plan, job.step, job.entropy, time_left, self.wait_ms(job.deadline))
        if go:
            job.x = features
        return go

    def _finish(self, job: Job) -> None:
        job.finished = time.monotonic()
        with self._cond:
            self._jobs -= 1
        try:
            job.on_done(job)
        except Exception:
            log.exception("completion callback of %s failed", job.id)
