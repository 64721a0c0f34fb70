"""``labkit.gateway``'s proxy: one OpenAI-compatible address in front of several servers
(chapter 5, :ref:`ch05-backend-dies`).

The gateway receives ``POST /v1/completions`` and ``/v1/chat/completions``, asks a router
(:mod:`labkit.gateway.routing`) which backend should serve each, forwards the request body
unchanged through one shared ``httpx.AsyncClient``, and relays the answer: a JSON body whole,
a server-sent-event stream event by event as the backend produces it (never collected first).
The backends are replicas of one deployment (vllm-router's regular mode assumes the same):
``GET /v1/models`` is the union of their models. ``GET /health`` is 200 while some backend is
routable and 503 otherwise; ``GET /metrics`` exposes the gateway's own Prometheus metrics.

What happens when things break (:mod:`labkit.gateway.proxy` runs each attempt):

* a backend that refuses the connection, answers 5xx, sends no first event within
  ``first_byte_timeout_s`` (a streamed request), or is ejected while the request waits,
  **before anything reached the client**, is counted as a failure and the request goes to
  another backend (each backend at most once per request). A stream counts as started once
  its first event has arrived: until then nothing was sent to the client, so a retry cannot
  duplicate a token;
* a stream cut after that (the backend died, or sent nothing for ``stream_idle_timeout_s``:
  it hangs) ends with an error event, ``data: {"error": {...}}``, then ``data: [DONE]``, the
  way vLLM reports an error in a running stream (its ``completion_stream_generator`` in
  ``vllm/entrypoints/openai/serving_completion.py`` yields
  ``create_streaming_error_response`` and then ``[DONE]``). Only whole events are relayed,
  so the client never sees half an event;
* no routable backend: 503 with an OpenAI error body (504 when every backend tried timed
  out); every candidate saturated (the endpoint picker's saturation detector): 429 with
  ``Retry-After``;
* an optional API key (vLLM's ``Authorization: Bearer`` scheme) guards ``/v1`` and the admin
  routes (401 without it), bodies over ``max_request_bytes`` get 413, and the CLI binds to
  127.0.0.1 unless told otherwise (and then asks for the key, or for the admin routes to be
  declared open: :func:`labkit.gateway.config.check_exposure`).

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
from collections.abc import Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from labkit.checks import ParameterError, in_range
from labkit.gateway.backends import BackendPool
from labkit.gateway.config import GatewayConfig
from labkit.gateway.endpoints import Endpoint, NoEndpointError, RoutingRequest, SaturatedError
from labkit.gateway.proxy import TIMEOUT_KINDS, Attempt, BackendFailed
from labkit.gateway.routing import Router, make_router
from labkit.http.openai import APIError, APIKeyAuthentication, add_error_handlers
from labkit.http.urls import normalize_url
from labkit.process import wait_until_async

#: vllm-router keeps up to 500 idle connections per host (``pool_max_idle_per_host`` in
#: ``src/server.rs``) and sets no cap on open ones. It keeps them 50 s; we keep them 2 s, less
#: than the 5 s after which uvicorn (``timeout_keep_alive``), and so ``labkit serve`` and vLLM,
#: close an idle connection: reusing one the server is closing at that moment fails the
#: request before its first byte, with nowhere to retry when only one backend is left.
KEEPALIVE_CONNECTIONS, KEEPALIVE_EXPIRY_S = 500, 2.0

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
ADMIN_PATHS = ("/add_worker", "/remove_worker", "/list_workers", "/workers")


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
    return RoutingRequest(model if isinstance(model, str) else None, text, session,
                          stream=payload.get("stream") is True)


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
        self.timeouts = Counter(
            "labkit_gateway_timeouts", "Attempts that timed out on this backend: kind "
            "'first_byte' (retried elsewhere) or 'stream_idle' (the stream was cut).",
            ["backend", "kind"], registry=r)
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
        """Export ``endpoint``'s live in-flight count and health, and its timeouts from 0."""
        for kind in TIMEOUT_KINDS:
            self.timeouts.labels(endpoint.url, kind)
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
        self.client: httpx.AsyncClient | None = None
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
            self.client = client
            await self.pool.start(client)
            try:
                yield
            finally:
                await self.pool.stop()
                self.client = None

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
        try:
            await wait_until_async(lambda: self.pool.healthy_now(self.client, url),
                                   self.config.worker_startup_timeout_s,
                                   self.config.probe_interval_s)
        except TimeoutError:
            raise APIError(400, f"Failed to add worker {url}: not healthy after "
                                f"{self.config.worker_startup_timeout_s:g} s", "url") from None
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
            *(self.client.get(e.url + "/v1/models", timeout=self.config.probe_timeout_s)
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
        arrived = anyio.current_time()
        body = await _read_body(request, self.config.max_request_bytes)
        routing = routing_request(body, request.headers.get(self.session_header))
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        tried: set[Endpoint] = set()
        failures: list[BackendFailed] = []
        while True:
            candidates = [e for e in self.pool.endpoints if e not in tried]
            try:
                endpoint = self.router.pick(routing, candidates, time.monotonic())
            except NoEndpointError as err:
                return self._no_backend(err, failures)
            except SaturatedError as err:
                raise APIError(429, str(err), headers={
                    "Retry-After": str(max(1, math.ceil(err.retry_after_s)))}) from None
            if failures:
                self.metrics.retries.labels(failures[-1].endpoint.url).inc()
            tried.add(endpoint)
            try:
                return await Attempt(self, endpoint, path, body, headers).run(routing, arrived)
            except BackendFailed as failure:
                failures.append(failure)

    def _no_backend(self, err: NoEndpointError, failures: list[BackendFailed]) -> Response:
        """The answer when no backend is left to try: the last backend's own 5xx if one
        answered; else an :class:`APIError`, 504 when every attempt timed out, 503 otherwise,
        whose message says what each attempt met."""
        answered = [f for f in failures if f.response is not None]
        if answered:
            last = answered[-1]
            self.metrics.requests.labels(last.endpoint.url,
                                         str(last.response.status_code)).inc()
            return last.response
        if not failures:
            raise APIError(503, f"no backend can take the request: {err}")
        why = "; ".join(f.why for f in failures)
        if all(f.timed_out for f in failures):
            raise APIError(504, f"every backend tried timed out: {why}")
        raise APIError(503, f"no backend can take the request: every backend tried failed: "
                            f"{why}")

    def release(self, endpoint: Endpoint, status: str, *, ok: bool | None) -> None:
        """Close the books on one request: in-flight count, passive health, metrics.
        ``ok`` None: the client left, which says nothing about the backend."""
        self.pool.closed(endpoint)
        if ok is True:
            self.pool.record_success(endpoint)
        elif ok is False:
            self.pool.record_failure(endpoint)
        self.metrics.requests.labels(endpoint.url, status).inc()


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
