"""``labkit.gateway``'s proxy: one OpenAI-compatible address in front of several servers
(chapter 5, :ref:`ch05-backend-dies`).

The gateway receives ``POST /v1/completions`` and ``/v1/chat/completions``, asks a router
(:mod:`labkit.gateway.routing`) which backend should serve each, forwards the request body
unchanged through one shared ``httpx.AsyncClient``, and relays the answer: a JSON body whole,
a server-sent-event stream event by event as the backend produces it (never collected first).
The backends are replicas of one deployment (vllm-router's regular mode assumes the same):
``GET /v1/models`` is the union of their models. ``GET /health`` is 200 while some backend is
routable and 503 otherwise; ``GET /metrics`` exposes the gateway's own Prometheus metrics.

What happens when things break:

* a backend that refuses the connection, times out, or answers 5xx **before anything reached
  the client** is counted as a failure and the request goes to another backend (each backend
  at most once per request). A stream counts as started once its first event has arrived:
  until then nothing was sent to the client, so a retry cannot duplicate a token;
* a stream cut after that (the backend died) ends with an error event, ``data: {"error":
  {...}}``, then ``data: [DONE]``, the way vLLM reports an error in a running stream (its
  ``completion_stream_generator`` in ``vllm/entrypoints/openai/serving_completion.py`` yields
  ``create_streaming_error_response`` and then ``[DONE]``). Only whole events are relayed,
  so the client never sees half an event;
* no routable backend: 503 with an OpenAI error body; every candidate saturated (the
  endpoint picker's saturation detector): 429 with ``Retry-After``;
* an optional API key (vLLM's ``Authorization: Bearer`` scheme) guards ``/v1`` and the admin
  routes (401 without it), bodies over ``max_request_bytes`` get 413, and the CLI binds to
  127.0.0.1 unless told otherwise.

Admin routes mirror vllm-router's dynamic worker API (vllm-project/router ``src/server.rs``;
the same routes and messages are in the 0.1.17 wheel's ``vllm_router_rs`` library), so an
autoscaler in another process can grow and shrink the pool:

* ``POST /add_worker?url=URL``: waits until ``URL/health`` answers 200 (checking every
  ``probe_interval_s``, for at most ``worker_startup_timeout_s``), then routes to it;
  200 ``Successfully added worker: URL``; 400 if it is already there or never got healthy.
* ``POST /remove_worker?url=URL[&drain_timeout_s=S]``: vllm-router removes at once; ours
  drains first: no new requests, then waits up to ``drain_timeout_s`` for the open ones,
  then removes; 200 ``Successfully removed worker: URL``; 404 for an unknown URL.
* ``GET /list_workers``: ``{"urls": [...]}``; ``GET /workers``: each backend's state.

Errors are OpenAI-style bodies here (vllm-router answers admin errors in plain text).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import Receive, Scope, Send

from labkit.checks import ParameterError, in_range
from labkit.gateway.backends import BackendPool
from labkit.gateway.config import GatewayConfig
from labkit.gateway.endpoints import Endpoint, NoEndpointError, RoutingRequest, SaturatedError
from labkit.gateway.routing import Router, make_router
from labkit.http.openai import APIError, APIKeyAuthentication, add_error_handlers, error_body
from labkit.http.sse import DONE_BYTES, event_bytes
from labkit.http.urls import normalize_url

#: vllm-router keeps up to 500 idle connections per host (``pool_max_idle_per_host`` in
#: ``src/server.rs``) and sets no cap on open ones. It keeps them 50 s; we keep them 2 s, less
#: than the 5 s after which uvicorn (``timeout_keep_alive``), and so ``labkit serve`` and vLLM,
#: close an idle connection: reusing one the server is closing at that moment fails the
#: request before its first byte, with nowhere to retry when only one backend is left.
KEEPALIVE_CONNECTIONS, KEEPALIVE_EXPIRY_S = 500, 2.0

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
ADMIN_PATHS = ("/add_worker", "/remove_worker", "/list_workers", "/workers")
# Hop-by-hop and framing headers: each side of the proxy sets its own (RFC 9110, 7.6.1).
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "date",
                  "server", "te", "trailer", "upgrade", "proxy-authenticate"}


def routing_request(body: bytes, session: str | None = None) -> RoutingRequest:
    """What the router sees of a request body: its model and its prompt text (chapter 5).

    A completion's prompt (a string, a list of strings, or token ids) or a chat's message
    contents, joined in order with newlines. Whatever does not parse gives an empty prompt:
    validating is the backend's job, and its 400 goes back to the client unchanged.
    """
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return RoutingRequest(None, "", session)
    model = payload.get("model")
    parts: list = []
    prompt, messages = payload.get("prompt"), payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: keep the text ones
                parts += [p.get("text") for p in content if isinstance(p, dict)]
            else:
                parts.append(content)
    elif isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        parts = prompt  # a batch of prompts
    else:
        parts = [prompt]  # one prompt: text, or a list of token ids
    text = "\n".join(" ".join(map(str, p)) if isinstance(p, list) else str(p)
                     for p in parts if isinstance(p, (str, int, list)))
    return RoutingRequest(model if isinstance(model, str) else None, text, session)


class GatewayMetrics:
    """The gateway's own Prometheus metrics, in their own registry (chapter 5, chapter 8)."""

    #: Seconds the gateway adds before a request leaves for its backend: sub-millisecond
    #: when all is well, up to seconds when failed attempts come first.
    ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05,
                             0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "labkit_gateway_requests", "Requests answered, by backend ('none' when the gateway "
            "answered itself) and HTTP status ('499': the client left first).",
            ["backend", "status"], registry=r)
        self.retries = Counter(
            "labkit_gateway_retries", "Requests sent to another backend after this one failed "
            "before the first byte reached the client.", ["backend"], registry=r)
        self.streams_cut = Counter(
            "labkit_gateway_streams_cut", "Streams that this backend cut short; the client got "
            "an error event.", ["backend"], registry=r)
        self.ejections = Counter("labkit_gateway_ejections", "Backends ejected after "
                                 "consecutive failures.", ["backend"], registry=r)
        self.readmissions = Counter("labkit_gateway_readmissions", "Ejected backends "
                                    "re-admitted after consecutive good probes.", ["backend"],
                                    registry=r)
        self.in_flight = Gauge("labkit_gateway_in_flight_requests", "Requests the gateway has "
                               "open on each backend.", ["backend"], registry=r)
        self.healthy = Gauge("labkit_gateway_backend_healthy", "1 while the backend is not "
                             "ejected.", ["backend"], registry=r)
        self.added_latency = Histogram(
            "labkit_gateway_added_latency_seconds", "Seconds from a request's arrival to its "
            "forwarding to the backend that answered it.", buckets=self.ADDED_LATENCY_BUCKETS,
            registry=r)

    def watch(self, endpoint: Endpoint) -> None:
        """Export ``endpoint``'s live in-flight count and health."""
        self.in_flight.labels(endpoint.url).set_function(lambda: endpoint.in_flight)
        self.healthy.labels(endpoint.url).set_function(lambda: float(endpoint.healthy))

    def unwatch(self, endpoint: Endpoint) -> None:
        self.in_flight.remove(endpoint.url)
        self.healthy.remove(endpoint.url)


class Gateway:
    """An OpenAI-compatible reverse proxy in front of ``backends`` (chapter 5).

    ``config`` (:class:`~labkit.gateway.config.GatewayConfig`, the defaults when ``None``)
    says how it routes, what it refuses, how long it waits, and how its pool
    (:class:`~labkit.gateway.backends.BackendPool`) scrapes, probes, ejects and re-admits
    backends. Serve ``app`` with any ASGI server (uvicorn in ``labkit gateway``); its lifespan
    starts and stops the pool.
    """

    def __init__(self, backends: Sequence[str], config: GatewayConfig | None = None) -> None:
        config = GatewayConfig() if config is None else config
        if not isinstance(config, GatewayConfig):
            raise ParameterError("config", f"config must be a GatewayConfig, got {config!r}")
        self.config = config
        self.router = _router(config)
        self.timeout = httpx.Timeout(connect=config.connect_timeout_s,
                                     read=config.read_timeout_s, write=config.read_timeout_s,
                                     pool=None)
        self.session_header = config.session_header.lower()
        self.metrics = GatewayMetrics()
        self.pool = BackendPool(backends, config, on_eject=self._ejected,
                                on_readmit=self._readmitted)
        for endpoint in self.pool.endpoints:
            self.metrics.watch(endpoint)
        self._client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _ejected(self, endpoint: Endpoint) -> None:
        self.metrics.ejections.labels(endpoint.url).inc()

    def _readmitted(self, endpoint: Endpoint) -> None:
        self.metrics.readmissions.labels(endpoint.url).inc()
        self.router.forget(endpoint.url)  # it may have restarted with an empty cache

    # -- the application ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI):
        # trust_env=False: an HTTP_PROXY in the environment must not capture loopback traffic.
        limits = httpx.Limits(max_connections=None,
                              max_keepalive_connections=KEEPALIVE_CONNECTIONS,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits,
                                     trust_env=False) as client:
            self._client = client
            await self.pool.start(client)
            try:
                yield
            finally:
                await self.pool.stop()
                self._client = None

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="labkit gateway", docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=self._lifespan)
        if self.config.api_key:
            app.add_middleware(APIKeyAuthentication, api_key=self.config.api_key,
                               protected=("/v1",) + ADMIN_PATHS)
        add_error_handlers(app)
        answer = app.exception_handlers[APIError]

        @app.exception_handler(APIError)
        async def _counted(request: Request, exc: APIError):
            # What the gateway answers itself on a proxied path counts as a request too.
            if request.url.path in PROXIED_PATHS:
                self.metrics.requests.labels("none", str(exc.status)).inc()
            return await answer(request, exc)

        for path in PROXIED_PATHS:
            app.post(path)(functools.partial(self.forward, path=path))

        @app.get("/v1/models")
        async def models() -> dict:
            return await self.models()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.pool.routable() else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        @app.post("/add_worker")
        async def add_worker(url: str) -> Response:
            return PlainTextResponse(await self.add_backend(url))

        @app.post("/remove_worker")
        async def remove_worker(url: str, drain_timeout_s: float | None = None) -> Response:
            return PlainTextResponse(await self.remove_backend(url, drain_timeout_s))

        @app.get("/list_workers")
        async def list_workers() -> dict:
            return {"urls": [e.url for e in self.pool.endpoints]}

        @app.get("/workers")
        async def workers() -> dict:
            return {"workers": [_describe(e) for e in self.pool.endpoints],
                    "total": len(self.pool.endpoints)}

        return app

    # -- admin --------------------------------------------------------------------------

    async def add_backend(self, url: str) -> str:
        """Route to ``url`` once its ``/health`` answers 200 (vllm-router's ``add_worker``)."""
        url = normalize_url(url)
        if self.pool.get(url) is not None:
            raise APIError(400, f"Worker already exists: {url}", "url")
        deadline = time.monotonic() + self.config.worker_startup_timeout_s
        while not await self.pool.healthy_now(self._client, url):
            if time.monotonic() >= deadline:
                raise APIError(400, f"Failed to add worker {url}: not healthy after "
                                        f"{self.config.worker_startup_timeout_s:g} s", "url")
            await asyncio.sleep(self.config.probe_interval_s)
        if self.pool.get(url) is not None:  # added by a concurrent call while we waited
            raise APIError(400, f"Worker already exists: {url}", "url")
        self.metrics.watch(self.pool.add(url))
        return f"Successfully added worker: {url}"

    async def remove_backend(self, url: str, drain_timeout_s: float | None = None) -> str:
        """Drain ``url`` (no new requests; wait up to ``drain_timeout_s`` seconds, default the
        gateway's, for the open ones), then stop routing to it and forget it."""
        endpoint = self.pool.get(url)
        if endpoint is None:
            raise APIError(404, f"Worker {normalize_url(url)} not found", "url")
        timeout_s = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        in_range("drain_timeout_s", timeout_s, 0)
        left = await self.pool.drain(endpoint, timeout_s)
        if endpoint in self.pool.endpoints:  # a concurrent remove may have finished first
            self.pool.remove(endpoint)
            self.metrics.unwatch(endpoint)
            self.router.forget(endpoint.url)
        note = f" ({left} requests still open after {timeout_s:g} s of draining)" if left else ""
        return f"Successfully removed worker: {endpoint.url}{note}"

    # -- models -------------------------------------------------------------------------

    async def models(self) -> dict:
        """The union of the routable backends' ``/v1/models``, first listing first."""
        endpoints = self.pool.routable()
        answers = await asyncio.gather(
            *(self._client.get(e.url + "/v1/models", timeout=self.config.probe_timeout_s)
              for e in endpoints), return_exceptions=True)
        by_id: dict[str, dict] = {}
        answered = False
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                answered = True
                for model in answer.json().get("data", []):
                    by_id.setdefault(model["id"], model)
        if not answered:
            raise APIError(503, "no backend is available to list its models")
        return {"object": "list", "data": list(by_id.values())}

    # -- forwarding ---------------------------------------------------------------------

    async def forward(self, request: Request, *, path: str) -> Response:
        """Send the request to a backend the router picks, retrying on another one while
        nothing has reached the client, and relay the answer."""
        arrived = time.perf_counter()
        body = await _read_body(request, self.config.max_request_bytes)
        routing = routing_request(body, request.headers.get(self.session_header))
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        tried: set[Endpoint] = set()
        failed: Endpoint | None = None
        last_5xx: Response | None = None
        while True:
            candidates = [e for e in self.pool.endpoints if e not in tried]
            try:
                endpoint = self.router.pick(routing, candidates, time.monotonic())
            except NoEndpointError as err:
                if last_5xx is not None:  # every backend failed: pass the last answer on
                    self.metrics.requests.labels(failed.url, str(last_5xx.status_code)).inc()
                    return last_5xx
                detail = "every backend tried failed" if tried else str(err)
                raise APIError(503, f"no backend can take the request: {detail}") from None
            except SaturatedError as err:
                raise APIError(429, str(err), headers={
                    "Retry-After": str(max(1, math.ceil(err.retry_after_s)))}) from None
            if failed is not None:
                self.metrics.retries.labels(failed.url).inc()
            tried.add(endpoint)
            attempt = _Attempt(self, endpoint, path, body, headers)
            try:
                response = await attempt.run(routing, arrived)
            except _BackendFailed as failure:
                failed, last_5xx = endpoint, failure.response or last_5xx
                continue
            return response

    def _release(self, endpoint: Endpoint, status: str, *, ok: bool | None) -> None:
        """Close the books on one request: in-flight count, passive health, metrics.
        ``ok`` None: the client left, which says nothing about the backend."""
        self.pool.closed(endpoint)
        if ok is True:
            self.pool.record_success(endpoint)
        elif ok is False:
            self.pool.record_failure(endpoint)
        self.metrics.requests.labels(endpoint.url, status).inc()


class _BackendFailed(Exception):
    """This attempt failed before anything reached the client: try another backend.
    ``response`` is the backend's own 5xx answer, if it gave one."""

    def __init__(self, response: Response | None = None) -> None:
        super().__init__()
        self.response = response


class _Attempt:
    """One try of one request on one backend."""

    def __init__(self, gateway: Gateway, endpoint: Endpoint, path: str, body: bytes,
                 headers: dict[str, str]) -> None:
        self.gateway, self.endpoint = gateway, endpoint
        self.path, self.body, self.headers = path, body, headers

    async def run(self, routing: RoutingRequest, arrived: float) -> Response:
        gateway, endpoint, pool = self.gateway, self.endpoint, self.gateway.pool
        client = gateway._client
        pool.opened(endpoint)
        sent = time.perf_counter()
        upstream = None
        try:
            upstream = await client.send(client.build_request(
                "POST", endpoint.url + self.path, content=self.body, headers=self.headers),
                stream=True)
            chunks = upstream.aiter_raw()
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                first = await anext(chunks)  # the stream starts only with its first event
                pool.record_ttft(endpoint, time.perf_counter() - sent)
            else:
                first = b"".join([chunk async for chunk in chunks])
                chunks = None
        except (httpx.TransportError, StopAsyncIteration):
            pool.closed(endpoint)
            pool.record_failure(endpoint)
            await _close(upstream)
            raise _BackendFailed() from None
        except BaseException:  # cancelled: the server is shutting down
            pool.closed(endpoint)
            await _close(upstream)
            raise
        headers = {k: v for k, v in upstream.headers.items() if k not in _NOT_FORWARDED}
        if upstream.status_code >= 500:
            pool.closed(endpoint)
            pool.record_failure(endpoint)
            await _close(upstream)
            raise _BackendFailed(Response(first, upstream.status_code, headers))
        gateway.router.record(routing, endpoint)
        gateway.metrics.added_latency.observe(sent - arrived)
        if chunks is None:
            gateway._release(endpoint, str(upstream.status_code), ok=True)
            await _close(upstream)
            return Response(first, upstream.status_code, headers)
        relay = _Relay(gateway, endpoint, upstream, chunks, first)
        return _RelayResponse(relay, upstream.status_code, headers)


async def _close(upstream: httpx.Response | None) -> None:
    """Close a backend response, shielded: this runs when the request is being cancelled
    (the client left), and an interrupted close would leave the connection half-read."""
    if upstream is not None:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


class _Relay:
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
                    chunk = await anext(self.chunks)
                except StopAsyncIteration:
                    break
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before data: [DONE]")
            self.outcome = (str(self.upstream.status_code), True)
        except httpx.TransportError as err:
            self.outcome = (str(self.upstream.status_code), False)
            self.gateway.metrics.streams_cut.labels(self.endpoint.url).inc()
            message = (f"the backend {self.endpoint.url} failed in the middle of the stream "
                       f"({type(err).__name__}: {err}); the response is incomplete")
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
        self.gateway._release(self.endpoint, status, ok=ok)
        await _close(self.upstream)


class _RelayResponse(StreamingResponse):
    """A streaming response that closes its relay whatever happens, client disconnects
    included (Starlette then cancels the task that iterates the events, which may leave the
    generator suspended and its ``finally`` unrun)."""

    def __init__(self, relay: _Relay, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), status_code=status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 past ``max_bytes`` (counting what arrives: a body
    may come without ``Content-Length``)."""
    too_large = APIError(413, f"the request body is larger than this gateway's limit of "
                                  f"{max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    return bytes(body)


def _describe(endpoint: Endpoint) -> dict:
    """One backend in ``GET /workers``: vllm-router's ``url``, ``is_healthy`` and ``load``
    (its open requests), then what else the gateway knows."""
    age_s = endpoint.metrics_age_s(time.monotonic())
    return {"url": endpoint.url, "is_healthy": endpoint.healthy, "load": endpoint.in_flight,
            "draining": endpoint.draining,
            "metrics_age_s": None if math.isinf(age_s) else age_s,
            "num_requests_waiting": endpoint.num_requests_waiting,
            "num_requests_running": endpoint.num_requests_running,
            "kv_cache_usage": endpoint.kv_cache_usage, "ttft_ewma_s": endpoint.ttft_ewma_s,
            "consecutive_failures": endpoint.consecutive_failures}




def _router(config: GatewayConfig) -> Router:
    """``config.strategy`` as a router. ``endpoint_picker`` and ``prefix_aware`` call metrics
    stale after :attr:`~labkit.gateway.config.GatewayConfig.metrics_staleness_s`: upstream's
    ratio to the scrape interval (200 ms against 50 ms), kept at this gateway's interval."""
    if isinstance(config.strategy, Router):
        return config.strategy
    options = ({"metrics_staleness_s": config.metrics_staleness_s}
               if config.strategy in ("endpoint_picker", "prefix_aware") else {})
    return make_router(config.strategy, seed=config.seed, **options)
