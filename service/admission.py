"""Admission: everything that can be refused from the request line and headers alone, before the body is read.

The API key, readiness, shutdown, queue room and the options of a binary body (all in the query string and headers)
with their plan. Under service/server.py this runs in the HTTP parser, so a refusal is written at once,
without a task and without waiting behind the event loop's queue; elsewhere the route runs it first thing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import DeadlineInfeasible, InvalidRequest, NotReady
from service.planner import Plan, Policy
from service.requests import Head, read_head, validate_options
from service.runtime import Runtime
from service.schemas import ClassifyOptions

CLASSIFY, BATCH = "/v1/classify", "/v1/classify/batch"


@dataclass
class Admitted:
    head: Head
    options: ClassifyOptions | None = None  # known now only for a binary body ...
    plan: Plan | None = None  # ... and so is its plan


def plan_for(runtime: Runtime, options: ClassifyOptions, arrival: float, where: str = "route") -> Plan:
    """The plan for a request that arrived at `arrival`, made in the HTTP parser or the route (`where`: the
    time its path still takes after the plan differs) (raises DeadlineInfeasible, UnknownRung)."""
    if options.policy is not Policy.FIXED and options.rung is not None:
        raise InvalidRequest("rung: only policy=fixed takes a rung")
    if runtime.planner.budget is not None:
        runtime.planner.budget.rate.arrive()
    deadline, path = arrival + options.deadline_ms / 1e3, runtime.paths[where]
    wait = runtime.scheduler.wait_ms(deadline)

    def plan(restrain: bool = True) -> Plan:
        time_left = (deadline - time.monotonic()) * 1e3 - path.ms  # e.g. decode, hand-offs
        return runtime.planner.plan(options.policy, time_left, wait, options.on_infeasible, options.rung, restrain)

    try:
        return plan()
    except DeadlineInfeasible:
        if not path.refused():
            raise
    # The estimate was dropped (many refusals, no answer): once more without it. A refusal then is the same
    # request's: the load restraint has counted it already.
    return plan(restrain=False)


def admit(runtime: Runtime, scope: Mapping[str, Any], batch: bool, arrival: float) -> Admitted:
    """Refuse (raise an ApiError) what cannot be served, using only `scope`'s headers and query string."""
    if runtime.api_key.enabled:  # first: an unauthorised client learns nothing of the server's state
        runtime.api_key.check(scope["headers"])
    if not runtime.ready.is_set():
        raise NotReady("the ladder is still loading", headers={"Retry-After": "1"})
    head = read_head(scope, batch)
    runtime.scheduler.check_room()
    if not head.options_complete:
        return Admitted(head)
    options = validate_options(head.fields)
    return Admitted(head, options, plan_for(runtime, options, arrival, "parser"))
