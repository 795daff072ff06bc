"""Prometheus metrics, in a registry of the app's own (so tests can build many apps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from service.timing import PhaseHistograms

M = TypeVar("M", bound=MetricWrapperBase)


def children(metric: M) -> Callable[..., M]:
    """`metric.labels`, each child looked up once: prometheus_client's own `labels` checks its arguments and takes
    a lock on every call, 2.2-3.3 us on this repository's 2-vCPU machine (2026-11-27, timeit), where the child's
    `inc` takes 0.5 us. Label values must come from a bounded set (a client's own strings do not belong in labels)."""
    found: dict[tuple[Any, ...], M] = {}

    def child(*values: Any) -> M:
        c = found.get(values)
        if c is None:  # two threads may both get here: `labels` returns the same child to both
            c = found[values] = metric.labels(*values)
        return c

    return child


_MS_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 200, 500, 1000, 5000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (what a soak watches)
        self.requests = Counter(
            "anytime_requests_total",
            "Requests by policy, answering rung and outcome",
            ["policy", "rung", "outcome"],
            registry=r,
        )
        self.deadline_misses = Counter(
            "anytime_deadline_misses_total", "Answers given after their deadline", registry=r
        )
        self.latency = Histogram(
            "anytime_latency_ms", "Arrival to answer, measured in the server (ms)", buckets=_MS_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "anytime_queue_ms", "Arrival to first engine start (ms)", buckets=_MS_BUCKETS, registry=r
        )
        self.exits = Counter("anytime_exit_total", "Answers by the exit that gave them", ["exit"], registry=r)
        self.batch = Histogram(
            "anytime_batch_size", "Items per engine run", ["engine"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.depth = Gauge("anytime_queue_depth", "Accepted requests not yet answered", registry=r)
        self.caution = Gauge(
            "anytime_auto_caution", "Factor on auto's predicted times, raised by its late answers", registry=r
        )
        self.in_flight = Gauge(
            "anytime_requests_in_flight", "Classify requests being served: body, plan, queue, run, answer", registry=r
        )
        self.arrivals = Gauge(
            "anytime_arrival_rate", "Classify requests per second, exponentially averaged (service/load.py)", registry=r
        )
        self.budget = Gauge(
            "anytime_auto_budget_ms", "Average engine time auto may give a request at the current rate", registry=r
        )
        self.path = Gauge(
            "anytime_path_ms",
            "Median time a request spends after planning outside the engines (decode, hand-offs); plans allow it",
            ["planned"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "anytime_loop_lag_ms",
            "How long each request waited from its parsing to the app starting it (the event loop's backlog)",
            buckets=(0.05, 0.1, 0.2, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 50),
            registry=r,
        )
        self.prediction_error = Histogram(
            "anytime_prediction_error_ms",
            "Observed minus predicted service time",
            ["engine"],
            buckets=(-5, -2, -1, -0.5, -0.2, 0, 0.2, 0.5, 1, 2, 5, 20),
            registry=r,
        )
        self.disconnects = Counter(
            "anytime_disconnects_total",
            "Clients that left before their answer, by where the request was (receive, queued, running)",
            ["where"],
            registry=r,
        )
        self.engine_failures = Counter(
            "anytime_engine_failures_total",
            "Engine runs that raised; the engine leaves service",
            ["engine"],
            registry=r,
        )
        self.phases = PhaseHistograms(r)
        # The labelled metrics the request path touches, by label values (see `children`).
        self.outcome, self.exit = children(self.requests), children(self.exits)
        self._batch, self._prediction_error = children(self.batch), children(self.prediction_error)

    def observe_batch(self, engine: str, size: int, error_ms: float) -> None:
        self._batch(engine).observe(size)
        self._prediction_error(engine).observe(error_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)
