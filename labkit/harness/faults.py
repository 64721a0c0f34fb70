"""A backend that fails in the middle of a load, and how every stream ended
(chapter 5, :ref:`ch05-backend-dies`, :ref:`ch05-timeouts`).

:func:`run_with_fault` streams requests through a router and, once a backend of a
:class:`~labkit.harness.fleet.BackendFleet` is busy, makes it fail one of two ways
(:data:`FAULTS`): ``kill`` (SIGKILL: a crash, connections reset at once) or ``stop``
(SIGSTOP for ``stop_s`` seconds, then SIGCONT: a hang, alive and accepting connections but
answering nothing, the failure that a proxy without timeouts spreads to its clients).
:class:`FaultRun` counts the outcomes a client sees (:data:`labkit.http.client.OUTCOMES`),
``hung`` for a request still open at the client's own deadline.

:func:`lying_metrics_app` is a third fault, for the routers rather than the process: a
backend whose ``/metrics`` reports ``NaN`` (or any value) for one sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

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
from labkit.process import wait_until_async
from labkit.simulate import BenchRequest

#: How :func:`run_with_fault` makes its victim fail.
FAULTS = ("kill", "stop")


@dataclass(frozen=True)
class FaultRun:
    """A load during which one backend failed (``fault``): how every stream ended."""

    fault: str
    results: list[StreamResult]
    faulted_after: int   # streams finished when the fault began
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


async def run_with_fault(base_url: str, fleet: BackendFleet, victim: int,
                         requests: Sequence[BenchRequest], *, fault: str = "kill",
                         concurrency: int = 8, fault_after: float = 1 / 3,
                         wait_running_s: float = 10.0, stop_s: float = 10.0,
                         deadline_s: float = 120.0) -> FaultRun:
    """Stream ``requests`` through the router at ``base_url`` and make backend ``victim`` of
    ``fleet`` fail in the middle: once a fraction ``fault_after`` of the streams has
    finished and the victim reports a request running (a running request has streamed its
    first token, so the fault catches a stream), or after ``wait_running_s`` more seconds if
    it never does. ``kill`` leaves it dead (restart it with ``fleet.restart(victim)``);
    ``stop`` resumes it after ``stop_s`` seconds while the load goes on. A request still
    open after ``deadline_s`` seconds is ``hung`` (chapter 5)."""
    if fault not in FAULTS:
        raise ParameterError("fault", f"fault must be one of {FAULTS}, got {fault!r}")
    in_range("fault_after", fault_after, 0, 1, high_open=True)
    in_range("wait_running_s", wait_running_s, 0)
    in_range("stop_s", stop_s, 0)
    finished = 0
    faulted_after = math.nan
    enough_finished = asyncio.Event()  # set once ``fault_after`` of the streams have ended
    if fault_after == 0:
        enough_finished.set()
    # The client's read timeout is left unbounded: ``deadline_s`` decides when it gives up.
    async with client_pool(base_url, concurrency) as (client, gate):
        async def one(request: BenchRequest) -> StreamResult:
            nonlocal finished
            async with gate:
                result = await stream_completion(client, fleet.model, request.prompt,
                                                 request.max_tokens, deadline_s=deadline_s)
            finished += 1
            if finished >= fault_after * len(requests):
                enough_finished.set()
            return result

        async def victim_running() -> bool:
            return await _running(client, fleet.urls[victim]) >= 1

        async def inject() -> None:
            nonlocal faulted_after
            await enough_finished.wait()
            with contextlib.suppress(TimeoutError):  # never running: fault it all the same
                await wait_until_async(victim_running, wait_running_s, 0.005)
            faulted_after = finished
            if fault == "kill":
                fleet.kill(victim)
                return
            fleet.pause(victim)
            try:
                await asyncio.sleep(stop_s)
            finally:
                fleet.resume(victim)

        start = time.perf_counter()
        *results, _ = await asyncio.gather(*(one(r) for r in requests), inject())
        duration_s = time.perf_counter() - start
    return FaultRun(fault, results, faulted_after, duration_s)


def lying_metrics_app(target: str, sample: str = "vllm:num_requests_waiting",
                      value: str = "NaN") -> FastAPI:
    """An app in front of the server at ``target`` that forwards every request unchanged
    (streams as they come) but reports ``value`` for every ``sample`` line of ``/metrics``:
    a backend whose exporter is broken, behind which the server still works. Serve it with
    :func:`labkit.harness.asgi.serve_in_thread` and route to its URL (chapter 5)."""
    line = re.compile(rf"^({re.escape(sample)}(?:\{{[^}}]*\}})?) \S+$", re.MULTILINE)
    client = httpx.AsyncClient(base_url=target, timeout=None, trust_env=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        upstream = await client.send(client.build_request(
            request.method, "/" + path, params=request.query_params,
            content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "")}), stream=True)
        if path == "metrics":
            text = (await upstream.aread()).decode()
            await upstream.aclose()
            return PlainTextResponse(line.sub(rf"\1 {value}", text),
                                     upstream.status_code,
                                     media_type=upstream.headers.get("content-type"))
        return StreamingResponse(upstream.aiter_raw(), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"),
                                 background=BackgroundTask(upstream.aclose))

    return app
