"""One earliest-deadline-first queue per device, worked at stage granularity, with dynamic batching.

A job is one request. Each work item runs one engine (a rung, or one cascade stage); a cascade's next
stage goes back into the queue with the job's deadline, so an urgent request can overtake it.

Batching is natural: the worker never waits for batch-mates. While it runs one batch, requests pile up,
and the next batch takes every queued item for the same engine that still meets its deadline. A lone
request runs at once.

A quick single request (its engine's profiled median at most `inline_max_ms`, and the engine takes
concurrent runs, as ONNX Runtime sessions do) that its route offers inline runs on the calling thread, the
event loop, at once, beside whatever the worker runs. A hand-off to the worker costs two thread wake-ups and a
GIL round trip: 0.1-0.2 ms on an idle 2-vCPU machine here, milliseconds under load, more than such an engine.
Running quick work inline only while the queue was empty made the server bistable under load: once work
queued, every request paid the hand-off, the queue kept growing, and the planner refused most of them.

So the route offers every request with a tight deadline (`inline_max_deadline_ms`, 5 ms), whatever the queue
holds. A looser deadline affords the hand-off, and under load the event loop's time is worth more than the
hand-off: such a request is offered only while it is the one request in the app (service/routes/classify.py;
docs/measurements.md, "Inline by deadline").

The default limit, 0.15 ms, is the issue's "~0.1 ms on the event loop" set so that the fastest rung runs inline on
either 2-vCPU machine measured here: ResNet exit 1 INT8 profiles at 0.07-0.08 ms on the AMD EPYC and 0.11-0.13 ms on
the Intel Xeon, where with a limit of 0.1 ms it went to the worker. Side by side on the Xeon (docs/measurements.md,
"The inline limit"), the worker's hand-off held that rung's requests 0.56-0.70 ms in the queue (median) at 400-800
req/s and put fewer of them on time at 2-3 ms deadlines than running it inline did, in every round.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engines.base import Engine, entropy
from service.errors import ApiError, DeadlineExpired, InternalError, QueueFull, ShuttingDown
from service.planner import Combiner, OnInfeasible, Plan, PlanKind, Planner, Policy
from service.predictor import LatencyPredictor

log = logging.getLogger("anytime.scheduler")


@dataclass(eq=False)
class Job:
    id: str
    arrival: float  # time.monotonic() when the request arrived
    deadline: float  # absolute, time.monotonic() clock
    x: np.ndarray  # (1, C, H, W)
    plan: Plan
    on_done: Callable[[Job], None]
    best_effort: bool = False  # the client takes a late answer rather than an error
    step: int = 0  # index of the next engine in plan.engines
    logits: np.ndarray | None = None  # the best answer so far
    entropy: float = float("nan")
    submitted: float | None = None  # when it entered the queue
    started: float | None = None  # when its first engine started
    finished: float | None = None
    run_s: float = 0.0  # time inside engines, all steps
    batch_sizes: list[int] = field(default_factory=list)
    member_logits: list[np.ndarray] = field(default_factory=list)  # a member cascade's members so far
    cancelled: bool = False
    error: ApiError | None = None


class Scheduler:
    def __init__(
        self,
        engines: dict[str, Engine],
        planner: Planner,
        predictor: LatencyPredictor,
        max_queue: int,
        max_batch: int,
        margin_ms: float,
        metrics: object | None = None,
        inline_max_ms: float = 0.0,
        combiners: dict[str, list[Combiner]] | None = None,
        batch_caps: dict[str, int] | None = None,
    ) -> None:
        self.engines, self.planner, self.predictor = engines, planner, predictor
        self.max_queue, self.max_batch, self.margin_ms = max_queue, max_batch, margin_ms
        self.inline_max_ms = inline_max_ms
        # The runtime's own dict, filled once its engines are loaded: `or {}` would swap an empty one for a copy.
        self.combiners = combiners if combiners is not None else {}  # per member cascade, one per prefix
        self.metrics = metrics
        # Engines that take at most so many items a run (a TensorRT plan's optimisation profile), by name.
        self.batch_caps = batch_caps or {}
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._busy_until = 0.0  # predicted end of the batch being run
        self._jobs = 0  # accepted jobs not yet finished
        self._draining = False
        self._stop = False
        self.crashed = False  # the worker died of a fault of its own
        self._thread = threading.Thread(target=self._work, name="anytime-worker", daemon=True)

    # -- client side ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The worker runs (or has not started yet) and has not died of a fault."""
        return not self.crashed and (self._thread.is_alive() or self._thread.ident is None)

    def drain(self) -> None:
        """Refuse new work from now on (503 shutting_down); what is queued still runs."""
        with self._cond:
            self._draining = True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the worker; jobs still queued are answered 503 shutting_down, never dropped silently."""
        with self._cond:
            self._stop = self._draining = True
            left = [entry[2] for entry in self._heap]
            self._heap.clear()
            self._cond.notify_all()
        for job in left:
            job.error = ShuttingDown("the server is shutting down", headers={"Retry-After": "1"})
            self._finish(job)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def wait_ms(self, deadline: float) -> float:
        """Predicted queueing delay for a job due at `deadline`: the running batch, then earlier-due items.

        Queued items of one engine run together, so they are counted as batches of up to its batch limit.
        """
        with self._cond:
            running = max(0.0, self._busy_until - time.monotonic()) * 1e3
            if not self._heap:
                return running
            ahead = Counter(j.plan.engines[j.step] for d, _, j in self._heap if d <= deadline)
        return running + sum(
            self.predictor.predict(e, min(n, self.batch_limit(e))) * math.ceil(n / self.batch_limit(e))
            for e, n in ahead.items()
        )

    def batch_limit(self, engine: str) -> int:
        """The most items one run of `engine` takes: max_batch, or less where the engine's profile stops."""
        return min(self.max_batch, self.batch_caps.get(engine, self.max_batch))

    def depth(self) -> int:
        return self._jobs

    def check_room(self, n: int = 1) -> None:
        """Raise (429 queue_full, 503 shutting_down) when `n` more jobs would not be accepted now."""
        if self.crashed:
            raise InternalError("internal error: the server cannot run models now")
        if self._draining:
            raise ShuttingDown("the server is shutting down", headers={"Retry-After": "1"})
        if self._jobs + n > self.max_queue:
            raise QueueFull(
                f"{self._jobs} requests in the queue (limit {self.max_queue}); retry shortly",
                headers={"Retry-After": "1"},
            )

    def submit(self, job: Job, inline: bool = False) -> None:
        """Queue the job for the worker, or with `inline` run its first engine now on this thread if it is quick.

        An inline run does not wait for earlier-due queued work: that runs on the worker at the same time.
        A cascade's later stages go to the worker as usual.
        """
        engine = job.plan.engines[job.step]
        inline = inline and self._quick(engine)
        with self._cond:
            self.check_room()
            self._jobs += 1
            job.submitted = time.monotonic()
            if not inline:
                heapq.heappush(self._heap, (job.deadline, next(self._seq), job))
                self._cond.notify()
        if inline:
            self._run_batch([job])

    def _quick(self, engine: str) -> bool:
        runner = self.engines.get(engine)
        return runner is not None and runner.concurrent and self.predictor.profiled_p50(engine) <= self.inline_max_ms

    def cancel(self, job: Job) -> bool:
        """The client went away: drop its queued work and free its slot at once.

        Returns whether it was still queued. A job that is running finishes its engine call (native code
        cannot be interrupted) and is then dropped without going on.
        """
        with self._cond:
            job.cancelled = True
            for i, entry in enumerate(self._heap):
                if entry[2] is job:
                    self._heap[i] = self._heap[-1]
                    self._heap.pop()
                    heapq.heapify(self._heap)
                    break
            else:
                return False
        self._finish(job)
        return True

    # -- worker side ---------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._heap and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    batch = self._take_batch()
                if batch:
                    self._run_batch(batch)
        except Exception:  # a fault in the scheduler itself: nothing queued may wait forever for an answer
            log.exception("the scheduler's worker stopped")
            self.crashed = True
            with self._cond:
                left = [entry[2] for entry in self._heap]
                self._heap.clear()
            for job in left:
                job.error = InternalError("internal error: the server cannot run models now")
                self._finish(job)

    def _run_batch(self, batch: list[Job]) -> None:
        engine = batch[0].plan.engines[batch[0].step]
        try:
            self._run(batch)
        except Exception:  # a failing engine must not fail its requests: it leaves service, they re-plan
            log.exception("engine %s failed: taken out of service", engine)
            self.planner.take_out(engine)
            if self.metrics is not None:
                self.metrics.engine_failures.labels(engine).inc()  # type: ignore[attr-defined]
            for job in batch:
                if job.finished is None:
                    self._replan(job)
        finally:
            with self._cond:
                if self._heap:  # a cascade's next stage may have been queued by an inline run
                    self._cond.notify()

    def _replan(self, job: Job) -> None:
        """A job whose engine failed: its best answer so far, or a new plan on the engines still in service."""
        if job.logits is not None:
            self._finish(job)
            return
        time_left = (job.deadline - time.monotonic()) * 1e3
        on_infeasible = OnInfeasible.BEST_EFFORT if job.best_effort else OnInfeasible.REJECT
        try:
            job.plan = self.planner.plan(
                job.plan.policy,
                time_left,
                self.wait_ms(job.deadline),
                on_infeasible,
                job.plan.name if job.plan.policy is Policy.FIXED else None,
            )
        except ApiError as e:
            job.error = e
            self._finish(job)
            return
        job.step, job.member_logits = 0, []
        with self._cond:
            heapq.heappush(self._heap, (job.deadline, next(self._seq), job))
            self._cond.notify()

    def _take_batch(self) -> list[Job]:
        """Pop the earliest-due runnable job and the queued jobs for the same engine that can share its run."""
        now = time.monotonic()
        while self._heap:
            _, _, head = heapq.heappop(self._heap)
            if self._fits_now(head, now):
                break
        else:
            return []
        engine = head.plan.engines[head.step]
        batch = [head]
        self._add_mates(batch, engine, now)
        self._busy_until = now + self.predictor.predict(engine, len(batch)) / 1e3
        return batch

    def _fits_now(self, job: Job, now: float) -> bool:
        """Can the job's next engine still finish by its deadline? If not, settle it without running late.

        Queueing can take longer than planned (earlier-due arrivals overtake). A cascade then answers with
        its best answer so far; a job with no answer yet moves to the most accurate plan that still fits,
        and gets 504 at once when none does. A best-effort job runs anyway, on the fastest plan.
        """
        time_left = (job.deadline - now) * 1e3
        if not job.plan.feasible or self.predictor.predict(job.plan.engines[job.step]) + self.margin_ms <= time_left:
            return True
        if job.logits is None:
            on_infeasible = OnInfeasible.BEST_EFFORT if job.best_effort else OnInfeasible.REJECT
            try:
                job.plan = self.planner.plan(job.plan.policy, time_left, 0.0, on_infeasible, job.plan.name)
                return True
            except ApiError:
                job.error = DeadlineExpired(f"{max(time_left, 0.0):.2f} ms were left after queueing: no rung fits")
                self.planner.observe(job.plan, -math.inf)
        self._finish(job)
        return False

    def _add_mates(self, batch: list[Job], engine: str, now: float) -> None:
        mates = [e for e in self._heap if e[2].plan.engines[e[2].step] == engine]
        if not mates:
            return
        chosen = []
        limit = self.batch_limit(engine)
        for entry in sorted(mates):
            if len(batch) >= limit:
                break
            members = [*batch, entry[2]]
            ms = self.predictor.predict(engine, len(members)) + self.margin_ms
            if all(not j.plan.feasible or now + ms / 1e3 <= j.deadline for j in members):
                batch.append(entry[2])
                chosen.append(entry)
        if chosen:
            ids = {id(e[2]) for e in chosen}
            self._heap = [e for e in self._heap if id(e[2]) not in ids]
            heapq.heapify(self._heap)

    def _run(self, batch: list[Job]) -> None:
        head = batch[0]
        name = head.plan.engines[head.step]
        x = np.concatenate([j.x for j in batch]) if len(batch) > 1 else head.x
        start = time.monotonic()
        for j in batch:
            j.started = j.started or start
        outputs = self.engines[name].run(x)
        now = time.monotonic()
        ms = (now - start) * 1e3
        error = self.predictor.observe(name, len(batch), ms)
        if self.metrics is not None:
            self.metrics.observe_batch(name, len(batch), error)  # type: ignore[attr-defined]
        for job in batch:
            job.step += 1
            job.run_s += now - start
            job.batch_sizes.append(len(batch))
        answers = self._answers(batch, outputs[-1])
        # Entropy is a stage cascade's gate: worked out here only for the jobs that may go on (the answer's own
        # is worked out from its probabilities, service/routes/classify.py); it cost a run ~12 us on small arrays.
        gated = [i for i, j in enumerate(batch) if j.plan.kind is PlanKind.STAGES and j.step < len(j.plan.engines)]
        if gated:
            for i, e in zip(gated, entropy(answers[gated]), strict=True):
                batch[i].entropy = float(e)
        for i, job in enumerate(batch):
            job.logits = answers[i : i + 1]
            if job.plan.kind is PlanKind.RUNG or self._stop or not self._go_on(job, outputs[0][i : i + 1], now):
                self._finish(job)
            else:
                with self._cond:
                    heapq.heappush(self._heap, (job.deadline, next(self._seq), job))

    def _answers(self, batch: list[Job], logits: np.ndarray) -> np.ndarray:
        """Each job's answer after this step: the engine's logits, or for a member cascade past its first
        member the stacker's combination of every member's so far (one stacker call per cascade and step)."""
        answers = logits
        groups: dict[tuple[str, int], list[int]] = {}
        for i, job in enumerate(batch):
            if job.plan.kind is PlanKind.MEMBERS:
                job.member_logits.append(logits[i : i + 1])
                if job.step > 1:
                    groups.setdefault((job.plan.name, job.step), []).append(i)
        for (name, step), rows in groups.items():
            if answers is logits:
                answers = logits.copy()
            combine = self.combiners[name][step - 2]
            features = [np.concatenate([batch[i].member_logits[m] for i in rows]) for m in range(step)]
            probs = combine(features)
            answers[rows] = np.log(np.clip(probs, 1e-12, None))
        return answers

    def _go_on(self, job: Job, features: np.ndarray, now: float) -> bool:
        if job.cancelled:
            return False
        if job.plan.kind is PlanKind.STAGES:
            score = job.entropy
        else:
            z = job.logits[0].astype(np.float64)  # type: ignore[index]
            score = float(1.0 / np.exp(z - z.max()).sum())  # the top probability
        time_left = (job.deadline - now) * 1e3
        go = self.planner.continue_cascade(job.plan, job.step, score, time_left, self.wait_ms(job.deadline))
        if go and job.plan.kind is PlanKind.STAGES:
            job.x = features  # the next stage runs on this one's features; a member runs on the image
        return go

    def _finish(self, job: Job) -> None:
        job.finished = time.monotonic()
        with self._cond:  # re-entrant: the worker may hold it already
            self._jobs -= 1
        try:
            job.on_done(job)
        except Exception:
            log.exception("completion callback of %s failed", job.id)
