"""A load in phases, such as calm, overload, calm, for watching a monitor react
(:ref:`ch08-scraping`, :ref:`ch08-alerts`).

:func:`scripted_load` runs :class:`LoadPhase` after :class:`LoadPhase`: in each, a fixed
number of requests in flight (a closed loop: a new request leaves when one ends), streamed
through :func:`labkit.http.client.stream_completion`. Against a server started with a small
``--max-num-seqs``, requests beyond that number wait in its queue
(``vllm:num_requests_waiting``), which is what chapter 8's queue alert watches; the lab runs
it under :class:`labkit.monitor.live_dashboard.LiveDashboard`, stamped on the monitor's clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from labkit.checks import ParameterError, in_range
from labkit.http.client import StreamResult, client_pool, stream_completion
from labkit.http.urls import normalize_url
from labkit.simulate import BenchRequest


@dataclass(frozen=True)
class LoadPhase:
    """Keep ``concurrency`` requests in flight for ``duration_s`` seconds (0: idle)."""

    concurrency: int
    duration_s: float

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) \
                or self.concurrency < 0:
            raise ParameterError("concurrency", f"concurrency must be an integer >= 0, "
                                                f"got {self.concurrency!r}")
        in_range("duration_s", self.duration_s, 0, low_open=True)


@dataclass
class PhaseResult:
    """What one phase sent, and when it started and ended on the load's clock (seconds)."""

    phase: LoadPhase
    start_s: float
    end_s: float
    results: list[StreamResult] = field(default_factory=list)


async def scripted_load(base_url: str, model: str, phases: Sequence[LoadPhase],
                        requests: Sequence[BenchRequest], *,
                        clock: Callable[[], float] = time.monotonic,
                        timeout_s: float = 300.0) -> list[PhaseResult]:
    """Run ``phases`` one after the other against ``base_url`` (chapter 8).

    In each phase ``concurrency`` workers send streamed completions back to back, taking
    ``requests`` in turn (cycling), until the phase's time is up; a request in flight then
    finishes, so the load falls as the queue drains, as it does when clients stop. The
    next phase starts on time regardless. ``clock`` stamps the phases (pass the monitor's
    ``now`` to line them up with its samples). Returns one :class:`PhaseResult` per phase.
    """
    if not phases:
        raise ParameterError("phases", "phases must hold at least one LoadPhase")
    if not requests:
        raise ParameterError("requests", "requests must hold at least one BenchRequest")
    # A phase's last requests finish while the next phase's workers start: connections for
    # twice the largest phase.
    connections = 2 * max(max(p.concurrency for p in phases), 1)
    turn = 0

    def next_request() -> BenchRequest:
        nonlocal turn
        request = requests[turn % len(requests)]
        turn += 1
        return request

    async with client_pool(normalize_url(base_url), connections, timeout_s) as (client, _):
        async def worker(record: PhaseResult, until: float) -> None:
            while time.monotonic() < until:
                request = next_request()
                record.results.append(await stream_completion(client, model, request.prompt,
                                                              request.max_tokens))

        out: list[PhaseResult] = []
        workers: list[asyncio.Task] = []
        for phase in phases:
            record = PhaseResult(phase, clock(), math.nan)
            until = time.monotonic() + phase.duration_s
            workers += [asyncio.create_task(worker(record, until))
                        for _ in range(phase.concurrency)]
            await asyncio.sleep(phase.duration_s)
            record.end_s = clock()
            out.append(record)
        await asyncio.gather(*workers)
    return out
