"""A backend crashed in the middle of a load, and how every stream ended
(chapter 5, :ref:`ch05-backend-dies`).

:func:`run_with_crash` streams requests through a router and SIGKILLs one backend of a
:class:`~labkit.harness.fleet.BackendFleet` once it is busy, so the crash cuts streams that
have started. :class:`CrashRun` counts the outcomes a client sees
(:data:`labkit.http.client.OUTCOMES`): labkit's gateway ends a cut stream with an error event,
vllm-router breaks it, and requests that had not started are retried elsewhere by both.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from labkit.simulate import BenchRequest
from labkit.checks import ParameterError, in_range
from labkit.harness.fleet import BackendFleet
from labkit.http.client import (
    OUTCOMES,
    StreamResult,
    client_pool,
    count_outcomes,
    stream_completion,
)
from labkit.http.metrics import sample_totals


@dataclass(frozen=True)
class CrashRun:
    """A load during which one backend was killed: how every stream ended."""

    results: list[StreamResult]
    killed_after: int   # streams finished when the backend was killed
    duration_s: float
    outcomes: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcomes", count_outcomes(self.results))

    def errors(self, outcome: str) -> Iterator[str]:
        """The error messages of the streams that ended as ``outcome``."""
        if outcome not in OUTCOMES:
            raise ParameterError("outcome", f"outcome must be one of {OUTCOMES}, "
                                            f"got {outcome!r}")
        return (r.error for r in self.results if r.outcome == outcome and r.error)


async def _running(client: httpx.AsyncClient, url: str) -> float:
    """``vllm:num_requests_running`` of one backend; 0 if it does not answer."""
    try:
        text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return 0.0
    totals = sample_totals(text, ["vllm:num_requests_running"])
    return totals.get("vllm:num_requests_running", 0.0)


async def run_with_crash(base_url: str, fleet: BackendFleet, victim: int,
                         requests: Sequence[BenchRequest], *, concurrency: int = 8,
                         kill_after: float = 1 / 3, wait_running_s: float = 10.0,
                         timeout_s: float = 120) -> CrashRun:
    """Stream ``requests`` through the router at ``base_url`` and SIGKILL backend
    ``victim`` of ``fleet`` in the middle: once a fraction ``kill_after`` of the streams has
    finished and the victim reports a request running (a running request has streamed its
    first token, so the crash cuts a stream), or after ``wait_running_s`` more seconds if it
    never does. The victim stays dead: restart it with ``fleet.restart(victim)``
    (chapter 5)."""
    in_range("kill_after", kill_after, 0, 1, high_open=True)
    in_range("wait_running_s", wait_running_s, 0)
    finished = 0
    killed_after = math.nan
    async with client_pool(base_url, concurrency, timeout_s) as (client, gate):
        async def one(request: BenchRequest) -> StreamResult:
            nonlocal finished
            async with gate:
                result = await stream_completion(client, fleet.model, request.prompt,
                                                 request.max_tokens)
            finished += 1
            return result

        async def crash() -> None:
            nonlocal killed_after
            while finished < kill_after * len(requests):
                await asyncio.sleep(0.01)
            deadline = time.monotonic() + wait_running_s
            while (time.monotonic() < deadline
                   and await _running(client, fleet.urls[victim]) < 1):
                await asyncio.sleep(0.005)
            fleet.kill(victim)
            killed_after = finished

        start = time.perf_counter()
        *results, _ = await asyncio.gather(*(one(r) for r in requests), crash())
        duration_s = time.perf_counter() - start
    return CrashRun(results, killed_after, duration_s)
