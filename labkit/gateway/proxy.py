"""One attempt of one request on one backend, and the relay of its stream, with the timeouts
that keep a hung backend from hanging its clients (chapter 5, :ref:`ch05-timeouts`).

:class:`~labkit.gateway.server.Gateway` picks a backend and runs an :class:`Attempt` on it.
The attempt forwards the body and waits for the backend's first byte: a stream's first
event, or a JSON answer whole. Until then nothing has reached the client, so whatever goes
wrong is a :class:`BackendFailed`, and the gateway tries another backend:

* the connection is refused or breaks, or the backend answers 5xx;
* a streamed attempt gets no first event within ``first_byte_timeout_s``: a **first-byte
  timeout**, which also counts that time as the backend's TTFT, so the least-latency
  strategy avoids it;
* the backend is ejected while the attempt waits (its probes or other requests failed): the
  attempt is **abandoned** at once rather than left to its timeout.

Once streaming, :class:`Relay` passes whole events on as they come. A stream that breaks, or
that goes ``stream_idle_timeout_s`` without a byte (a **stream idle timeout**), ends with an
error event and ``data: [DONE]``, as vLLM ends a stream that fails; the backend's connection
is closed, which aborts the request there if it still runs. Every timeout counts as a failure
of its backend (``eject_after`` in a row eject it) and in
``labkit_gateway_timeouts_total{backend, kind}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from labkit.gateway.endpoints import Endpoint, RoutingRequest
from labkit.http.openai import error_body
from labkit.http.sse import DONE_BYTES, event_bytes

if TYPE_CHECKING:
    from labkit.gateway.server import Gateway

# Hop-by-hop and framing headers: each side of the proxy sets its own (RFC 9110, 7.6.1).
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "date",
                  "server", "te", "trailer", "upgrade", "proxy-authenticate"}

#: The kinds of ``labkit_gateway_timeouts_total``.
TIMEOUT_KINDS = ("first_byte", "stream_idle")


class BackendFailed(Exception):
    """An attempt on ``endpoint`` failed before anything reached the client: try another
    backend. ``why`` says how; ``response`` is the backend's own 5xx answer, if it gave one;
    ``timed_out`` marks a first-byte timeout."""

    def __init__(self, endpoint: Endpoint, why: str, response: Response | None = None, *,
                 timed_out: bool = False) -> None:
        super().__init__(f"{endpoint.url}: {why}")
        self.endpoint, self.response, self.timed_out = endpoint, response, timed_out
        self.why = str(self)


class Attempt:
    """One try of one request on one backend."""

    def __init__(self, gateway: Gateway, endpoint: Endpoint, path: str, body: bytes,
                 headers: dict[str, str]) -> None:
        self.gateway, self.endpoint = gateway, endpoint
        self.path, self.body, self.headers = path, body, headers

    async def run(self, routing: RoutingRequest, arrived: float) -> Response:
        """The answer to relay, or :class:`BackendFailed`. ``arrived`` is when the request
        reached the gateway (``time.perf_counter``)."""
        gateway, endpoint, pool = self.gateway, self.endpoint, self.gateway.pool
        client, config = gateway.client, gateway.config
        # A non-streamed answer comes whole when it is complete: only read_timeout_s bounds it.
        timeout_s = config.first_byte_timeout_s if routing.stream else None
        pool.opened(endpoint)
        sent = anyio.current_time()
        upstream = None
        try:
            with pool.until_first_byte(endpoint, timeout_s) as waiting:
                upstream = await client.send(client.build_request(
                    "POST", endpoint.url + self.path, content=self.body, headers=self.headers),
                    stream=True)
                chunks = upstream.aiter_raw()
                if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    first = await anext(chunks)  # the stream starts only with its first event
                    pool.record_ttft(endpoint, anyio.current_time() - sent)
                else:
                    first = b"".join([chunk async for chunk in chunks])
                    chunks = None
        except (httpx.TransportError, StopAsyncIteration) as err:
            await self._failed(upstream)
            raise BackendFailed(endpoint, f"{type(err).__name__} {err}".strip()) from None
        except BaseException:  # cancelled: the client left or the server is shutting down
            pool.closed(endpoint)
            await _close(upstream)
            raise
        if waiting.cancelled_caught:
            if anyio.current_time() < waiting.deadline:  # ejected while it waited
                pool.closed(endpoint)
                await _close(upstream)
                raise BackendFailed(endpoint, "ejected before it answered")
            gateway.metrics.timeouts.labels(endpoint.url, "first_byte").inc()
            pool.record_ttft(endpoint, timeout_s)
            await self._failed(upstream)
            raise BackendFailed(endpoint, f"no first byte within {timeout_s:g} s",
                                timed_out=True)
        headers = {k: v for k, v in upstream.headers.items() if k not in _NOT_FORWARDED}
        if upstream.status_code >= 500:
            await self._failed(upstream)
            raise BackendFailed(endpoint, f"HTTP {upstream.status_code}",
                                Response(first, upstream.status_code, headers))
        gateway.router.record(routing, endpoint)
        gateway.metrics.added_latency.observe(sent - arrived)
        if chunks is None:
            gateway.release(endpoint, str(upstream.status_code), ok=True)
            await _close(upstream)
            return Response(first, upstream.status_code, headers)
        return RelayResponse(Relay(gateway, endpoint, upstream, chunks, first),
                             upstream.status_code, headers)

    async def _failed(self, upstream: httpx.Response | None) -> None:
        pool = self.gateway.pool
        pool.closed(self.endpoint)
        pool.record_failure(self.endpoint)
        await _close(upstream)


async def _close(upstream: httpx.Response | None) -> None:
    """Close a backend response, shielded: this runs when the request is being cancelled
    (the client left), and an interrupted close would leave the connection half-read."""
    if upstream is not None:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


class Relay:
    """One server-sent-event stream relayed from a backend to the client, whole events only.

    The backend's bytes are cut at event boundaries (a blank line) and each complete event
    goes out as soon as it is complete, so a stream cut mid-event never shows the client half
    an event before the error event.
    """

    def __init__(self, gateway: Gateway, endpoint: Endpoint, upstream: httpx.Response,
                 chunks: AsyncIterator[bytes], first: bytes) -> None:
        self.gateway, self.endpoint, self.upstream = gateway, endpoint, upstream
        self.chunks, self.first = chunks, first
        self.outcome: tuple[str, bool | None] = ("499", None)  # until the stream ends
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        pending, done = b"", False
        idle_s = self.gateway.config.stream_idle_timeout_s
        url, metrics = self.endpoint.url, self.gateway.metrics
        try:
            chunk = self.first
            while True:
                pending += chunk
                end = pending.rfind(b"\n\n") + 2
                if end > 1:
                    complete, pending = pending[:end], pending[end:]
                    done = complete.endswith(DONE_BYTES)
                    yield complete
                try:
                    with anyio.fail_after(idle_s):
                        chunk = await anext(self.chunks)
                except StopAsyncIteration:
                    break
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before data: [DONE]")
            self.outcome = (str(self.upstream.status_code), True)
        except (httpx.TransportError, TimeoutError) as err:
            self.outcome = (str(self.upstream.status_code), False)
            metrics.streams_cut.labels(url).inc()
            if isinstance(err, TimeoutError):
                metrics.timeouts.labels(url, "stream_idle").inc()
                why = f"sent nothing for {idle_s:g} s"
            else:
                why = f"failed ({type(err).__name__}: {err})"
            message = (f"the backend {url} {why} in the middle of the stream; "
                       "the response is incomplete")
            yield event_bytes(error_body(502, message))
            yield DONE_BYTES
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the books and the upstream response (the backend aborts the request if it
        still runs), exactly once, however the stream ended."""
        if self._closed:
            return
        self._closed = True
        status, ok = self.outcome
        self.gateway.release(self.endpoint, status, ok=ok)
        await _close(self.upstream)


class RelayResponse(StreamingResponse):
    """A streaming response that closes its relay whatever happens, client disconnects
    included (Starlette then cancels the task that iterates the events, which may leave the
    generator suspended and its ``finally`` unrun)."""

    def __init__(self, relay: Relay, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), status_code=status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()
