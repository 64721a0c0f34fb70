"""The client side of an OpenAI-compatible server: a pool of connections held to a concurrency,
and one streamed completion classified the way a client sees it end (chapters 2, 5 and 8).

The benchmark (:mod:`labkit.bench`), the load generators of the labs
(:mod:`labkit.harness.load`, :mod:`labkit.harness.faults`) and the monitor's live load all
send many streams at once through one :func:`client_pool`: one ``httpx.AsyncClient`` whose
connections suffice for ``concurrency`` streams, and the semaphore that keeps at most that many
open. :func:`stream_completion` sends one greedy streamed ``/v1/completions`` request and says
how it ended (:data:`OUTCOMES`), which is what chapter 5's crash experiments count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

from labkit.checks import in_range, positive_int
from labkit.http.sse import IncompleteStream, read_events

#: Connections beyond ``concurrency`` in a :func:`client_pool`: a load that also reads the
#: servers' ``/metrics`` or ``/health`` through the same client while every stream is open
#: (a crash experiment waits for a running request that way) needs a few more.
SPARE_CONNECTIONS = 4

#: Seconds an idle pooled connection is kept: less than the servers' own keep-alive timeout
#: (uvicorn's, and so ``labkit serve``'s, the gateway's and vLLM's, is 5 s, as is httpx's
#: default expiry). Reusing a connection at the instant the server closes it fails the request
#: with a ``ReadError`` that no server-side fault caused.
KEEPALIVE_EXPIRY_S = 1.0

#: How a streamed request can end, seen from the client (:class:`StreamResult`).
OUTCOMES = ("complete", "cut", "broken", "lost", "shed", "hung")


@contextlib.asynccontextmanager
async def client_pool(base_url: str, concurrency: int, timeout_s: float | None = None,
                      api_key: str | None = None
                      ) -> AsyncIterator[tuple[httpx.AsyncClient, asyncio.Semaphore]]:
    """``(client, gate)``: an ``httpx.AsyncClient`` for ``base_url`` with connections for
    ``concurrency`` streams (plus :data:`SPARE_CONNECTIONS`), and the semaphore a sender holds
    while its request is open, so at most ``concurrency`` are. ``timeout_s`` bounds each
    connect and read (``None``: no bound). The environment's proxy settings are ignored: an
    ``HTTP_PROXY`` must not capture loopback traffic. ``api_key`` goes with every request as
    a bearer token, as the OpenAI client sends it to a server started with one.

        async with client_pool(url, 8, timeout_s=120) as (client, gate):
            async with gate:
                result = await stream_completion(client, model, prompt, 16)
    """
    positive_int("concurrency", concurrency)
    limits = httpx.Limits(max_connections=concurrency + SPARE_CONNECTIONS,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 trust_env=False, headers=headers) as client:
        yield client, asyncio.Semaphore(concurrency)


@dataclass(frozen=True)
class StreamResult:
    """How one streamed completion ended (one of :data:`OUTCOMES`), what it said, and when.

    * ``complete``: HTTP 200 and ``data: [DONE]``, no error event;
    * ``cut``: the stream ended with an error event (``data: {"error": ...}``) and then
      ``[DONE]``: the client knows its answer is incomplete;
    * ``broken``: it streamed, then ended without ``[DONE]`` (a truncated body): the client
      cannot tell an incomplete answer from a complete one except by that absence;
    * ``lost``: nothing streamed (a 5xx, a refused or dropped connection);
    * ``shed``: 429, refused on purpose (``Retry-After`` says when to come back);
    * ``hung``: still open when the client's own deadline passed (``deadline_s``), streaming
      or not: the client gave up on it.

    ``ttft_ms`` runs from sending to the first event that carries a choice; ``e2el_ms`` to
    the end of the stream; both are ``None`` when no token came.
    """

    outcome: str
    text: str = ""
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str,
                            max_tokens: int, *, headers: Mapping[str, str] | None = None,
                            deadline_s: float | None = None) -> StreamResult:
    """Send one greedy streamed ``/v1/completions`` request through ``client`` (its base URL
    is the gateway or server) and classify how it ended (:ref:`ch05-backend-dies`). After
    ``deadline_s`` seconds (``None``: never) the client gives up: ``hung``."""
    positive_int("max_tokens", max_tokens)
    if deadline_s is not None:
        in_range("deadline_s", deadline_s, 0, low_open=True)
        try:
            return await asyncio.wait_for(
                stream_completion(client, model, prompt, max_tokens, headers=headers),
                deadline_s)
        except asyncio.TimeoutError:
            return StreamResult("hung", error=f"still open after {deadline_s:g} s")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    pieces: list[str] = []
    first = None
    done, error = False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=dict(headers or {})) as response:
            if response.status_code != 200:
                await response.aread()
                outcome = "shed" if response.status_code == 429 else "lost"
                return StreamResult(outcome, error=f"HTTP {response.status_code}: "
                                                   f"{response.text[:300]}")
            async for event in read_events(response.aiter_lines()):
                if "error" in event:
                    error = event["error"].get("message", str(event["error"]))
                elif event.get("choices"):
                    first = first or time.perf_counter()
                    pieces.append(event["choices"][0].get("text") or "")
            done = True
    except IncompleteStream:
        pass
    except httpx.HTTPError as err:
        # Streamed first, then the connection broke: broken; nothing streamed: lost.
        error = f"{type(err).__name__}: {err}"
        if first is None:
            return StreamResult("lost", error=error)
    end = time.perf_counter()
    ttft_ms = None if first is None else 1e3 * (first - start)
    e2el_ms = None if first is None else 1e3 * (end - start)
    if error is not None and done:
        outcome = "cut"
    elif not done:
        outcome = "broken" if first is not None else "lost"
        error = error or "the stream ended without data: [DONE]"
    else:
        outcome = "complete"
    return StreamResult(outcome, "".join(pieces), ttft_ms, e2el_ms, error)


def count_outcomes(results: Sequence[StreamResult]) -> dict[str, int]:
    """``{outcome: how many}`` with every outcome of :data:`OUTCOMES`, zeros included."""
    counts = Counter(r.outcome for r in results)
    return {outcome: counts[outcome] for outcome in OUTCOMES}
