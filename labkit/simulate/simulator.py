"""A discrete-event simulator of one serving engine (:ref:`ch03-simulating`).

Events sit in a heap ordered by time: request arrivals, and the end of the step the engine is
running. Whenever the engine is idle and has work, it asks the scheduler for a batch and the
cost model for how long that batch takes. Nothing sleeps: a minute of traffic simulates in a
fraction of a second, and the same seed gives the same result.

This loop is the reference, one step at a time. :mod:`labkit.simulate.fast` takes the same
steps with far less work per step and is what :func:`simulate` runs by default.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence

from labkit.checks import ParameterError
from labkit.scheduling import Request, Scheduler
from labkit.simulate.cost import StepCostModel
from labkit.simulate.fast import can_simulate_fast, simulate_fast
from labkit.simulate.metrics import BenchmarkResult
from labkit.simulate.records import SimulationResult, StepRecord
from labkit.simulate.speculation import PlannedSpeculator, SimulatedSpeculation


def simulate(scheduler, requests: Sequence[Request], step_cost: StepCostModel,
             max_steps: int = 10_000_000, fast: bool = True,
             speculation: SimulatedSpeculation | None = None) -> SimulationResult:
    """Run ``requests`` through ``scheduler`` (a :class:`~labkit.scheduling.Scheduler` or
    :class:`~labkit.scheduling.StaticBatchScheduler`), timing each step with ``step_cost``.

    With ``fast`` (the default) a fresh ``Scheduler`` with planned requests runs on
    :mod:`labkit.simulate.fast`: the same steps and numbers, many times sooner. Otherwise, and
    for any other scheduler, the loop below runs one event at a time. ``speculation`` makes
    every decoding request verify drafts of its planned tokens (chapter 9), in the loop below.
    """
    if not requests:
        raise ParameterError("requests", "requests must not be empty")
    speculator = PlannedSpeculator(speculation) if speculation is not None else None
    if speculator and not isinstance(scheduler, Scheduler):
        raise ParameterError("speculation", "speculation needs continuous batching (a "
                             f"Scheduler), not a {type(scheduler).__name__}")
    if fast and speculator is None and can_simulate_fast(scheduler, requests):
        return simulate_fast(scheduler, requests, step_cost, max_steps)
    order = itertools.count()
    events: list[tuple[float, int, str, object]] = [
        (r.arrival_time, next(order), "arrival", r) for r in requests]
    heapq.heapify(events)
    result = SimulationResult(list(requests))
    busy = False
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # everything that happens at ``now`` first
            _, _, kind, payload = heapq.heappop(events)
            if kind == "arrival":
                scheduler.add_request(payload)
                continue
            step_start, out = payload
            if speculator:  # the tokens each verification emits
                scheduler.update(out, now, speculator.verify(out))
            else:
                scheduler.update(out, now)
            result.steps.append(StepRecord(
                step_start, now, out.total_num_scheduled_tokens, len(scheduler.running),
                len(scheduler.waiting), scheduler.kv_cache.usage, scheduler.num_preemptions))
            busy = False
        if busy or not scheduler.has_unfinished_requests():
            continue
        if len(result.steps) >= max_steps:
            raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
        if speculator:
            speculator.propose(scheduler.running)
        out = scheduler.schedule()
        if out.requests:
            seconds = step_cost(out.rows) + (speculator.draft_time(out, step_cost)
                                             if speculator else 0.0)
            heapq.heappush(events, (now + seconds, next(order), "step", (now, out)))
            busy = True
        elif not scheduler.running and not events:
            raise RuntimeError("scheduler cannot run any waiting request")
    return result


def sweep(rates: Sequence[float], make_requests: Callable[[float], Sequence[Request]],
          make_scheduler: Callable[[], object], step_cost: StepCostModel,
          slos_ms: Mapping[str, float] | None = None,
          speculation: SimulatedSpeculation | None = None
          ) -> list[tuple[float, BenchmarkResult]]:
    """Simulate one fresh scheduler per offered request rate: the throughput-latency curve
    (with ``speculation``, of a server that speculates)."""
    return [(rate, simulate(make_scheduler(), make_requests(rate), step_cost,
                            speculation=speculation).summary(slos_ms))
            for rate in rates]
