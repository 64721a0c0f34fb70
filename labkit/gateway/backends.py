"""The gateway's backend pool: who is up, how loaded, how fast
(:ref:`ch05-choosing-backend`, :ref:`ch05-backend-dies`).

One :class:`~labkit.gateway.endpoints.Endpoint` per backend server, kept current three ways:

* **scraped load**: every ``scrape_interval_s`` the pool reads each backend's ``/metrics``
  (vLLM's names, which ``labkit serve`` exports too: ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and the prefix-cache counters),
  because queue depth and KV-cache use change within a second (the Gateway API Inference
  Extension's endpoint picker scrapes every 50 ms; our default is in
  :mod:`labkit.gateway.config`).
* **health**: active ``GET /health`` probes every ``probe_interval_s``, plus passive counting
  of the requests the gateway forwards (a refused connection, a 5xx, a stream cut short, and
  the proxy's first-byte and stream-idle timeouts). A hung backend fails its probes only after
  ``probe_timeout_s`` each, three times over; its requests time out together, so they usually
  eject it first. ``eject_after`` consecutive failures eject a backend; while ejected it is
  only probed, and ``readmit_after`` consecutive successful probes bring it back. The defaults,
  3 and 2, are vllm-router's ``health_failure_threshold`` and ``health_success_threshold``
  (vllm-router 0.1.17, ``vllm_router/router_args.py``).
* **the gateway's own view**: how many requests it has open on each backend (``in_flight``)
  and an exponentially weighted moving average of the time to first token it measured
  (``ttft_ewma_s``), for the least-latency strategy.

A router (:mod:`labkit.gateway.routing`) only reads these records; all I/O happens here and
in :mod:`labkit.gateway.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence

import anyio
import httpx

from labkit.checks import ParameterError
from labkit.gateway.config import GatewayConfig
from labkit.gateway.endpoints import Endpoint
from labkit.http.metrics import parse_samples
from labkit.http.urls import normalize_url
from labkit.process import wait_until_async

#: Weight of the newest sample in the TTFT average: ``ewma = a * sample + (1 - a) * ewma``.
#: With a = 0.25 a sample's weight halves every ln 2 / -ln 0.75 = 2.4 requests, so a backend
#: that slows down is noticed within a handful of requests, while one slow outlier moves the
#: average only a quarter of the way towards it.
TTFT_EWMA_ALPHA = 0.25

#: The backend samples the pool reads (vLLM's names), and the Endpoint field of each.
SCRAPED_METRICS = {
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


def parse_backend_metrics(text: str) -> dict[str, float]:
    """The load figures in one ``/metrics`` page, keyed by :class:`Endpoint` field name
    (chapter 5).

    Counts and counters are summed over label sets (vLLM labels each data-parallel engine
    separately; the server's total is their sum); the KV-cache usage, a fraction, is their
    mean. A sample the page lacks is left out; a page that is not Prometheus' text format
    raises :class:`~labkit.checks.ParameterError` (:func:`labkit.http.metrics.parse_samples`).
    """
    values: dict[str, list[float]] = {}
    for name, _, value in parse_samples(text, SCRAPED_METRICS):
        values.setdefault(SCRAPED_METRICS[name], []).append(value)
    return {field: (sum(v) / len(v) if field == "kv_cache_usage" else sum(v))
            for field, v in values.items()}


class BackendPool:
    """The backends behind one gateway, their health and their load (chapter 5).

    ``config`` gives the scrape and probe intervals, the probe timeout and the ejection and
    re-admission thresholds (:class:`~labkit.gateway.config.GatewayConfig`; its other fields
    are the proxy's; ``None``: the defaults). ``on_eject(endpoint)`` and
    ``on_readmit(endpoint)`` are called on each transition (the gateway counts them in its own
    metrics). :meth:`start` runs the scrape and probe loops on the running event loop with the
    given client; ``stop()`` ends them. Not thread-safe: everything runs on the gateway's one
    event loop.
    """

    def __init__(self, urls: Sequence[str], config: GatewayConfig | None = None, *,
                 on_eject: Callable[[Endpoint], None] | None = None,
                 on_readmit: Callable[[Endpoint], None] | None = None) -> None:
        config = GatewayConfig() if config is None else config
        if not isinstance(config, GatewayConfig):
            raise ParameterError("config", f"config must be a GatewayConfig, got {config!r}")
        self.config = config
        self._on_eject, self._on_readmit = on_eject, on_readmit
        self.endpoints: list[Endpoint] = []
        self._client: httpx.AsyncClient | None = None
        self._watchers: dict[Endpoint, tuple[asyncio.Task, asyncio.Task]] = {}
        # The attempts waiting for their first byte on each endpoint: abandoned on ejection.
        self._awaiting: dict[Endpoint, set[anyio.CancelScope]] = {}
        for url in urls:
            self.add(url)

    # -- membership ---------------------------------------------------------------------

    def get(self, url: str) -> Endpoint | None:
        url = normalize_url(url)
        return next((e for e in self.endpoints if e.url == url), None)

    def add(self, url: str) -> Endpoint:
        """A new backend, routable at once (the caller checked its health first)."""
        url = normalize_url(url)
        if self.get(url) is not None:
            raise ParameterError("url", f"Worker already exists: {url}")
        endpoint = Endpoint(url)
        self.endpoints.append(endpoint)
        if self._client is not None:  # started: watch it from now on
            self._watch(endpoint)
        return endpoint

    def remove(self, endpoint: Endpoint) -> None:
        """Forget ``endpoint``; requests still open on it finish on their own."""
        self.endpoints.remove(endpoint)
        self._awaiting.pop(endpoint, None)
        for task in self._watchers.pop(endpoint, ()):
            task.cancel()

    def routable(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.routable]

    async def drain(self, endpoint: Endpoint, timeout_s: float) -> int:
        """Stop new requests to ``endpoint`` and wait up to ``timeout_s`` seconds for its open
        ones to finish; returns how many are still open (0 when it drained)."""
        endpoint.draining = True
        with contextlib.suppress(TimeoutError):
            await wait_until_async(lambda: not endpoint.in_flight, timeout_s, 0.05)
        return endpoint.in_flight

    # -- the gateway's own accounting ---------------------------------------------------

    @staticmethod
    def opened(endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.sent_since_scrape += 1

    @staticmethod
    def closed(endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1

    @contextlib.contextmanager
    def until_first_byte(self, endpoint: Endpoint,
                         timeout_s: float | None) -> Iterator[anyio.CancelScope]:
        """The cancel scope an attempt waits for ``endpoint``'s first byte in: it expires
        after ``timeout_s`` seconds (never when ``None``), and :meth:`record_failure`
        cancels it at once if the wait outlasts the endpoint's health. The attempt reads
        ``cancelled_caught`` and the deadline to tell the two apart."""
        deadline = math.inf if timeout_s is None else anyio.current_time() + timeout_s
        scope = anyio.CancelScope(deadline=deadline)
        waiting = self._awaiting.setdefault(endpoint, set())
        waiting.add(scope)
        try:
            with scope:
                yield scope
        finally:
            waiting.discard(scope)

    @staticmethod
    def record_ttft(endpoint: Endpoint, ttft_s: float) -> None:
        """Fold one measured time to first token (seconds) into ``endpoint.ttft_ewma_s``."""
        previous = endpoint.ttft_ewma_s
        endpoint.ttft_ewma_s = (ttft_s if previous is None
                                else TTFT_EWMA_ALPHA * ttft_s + (1 - TTFT_EWMA_ALPHA) * previous)

    def record_success(self, endpoint: Endpoint, *, probe: bool = False) -> None:
        """A request or probe that the backend answered properly. Only probes re-admit an
        ejected backend: a request that was already open on it when it was ejected proves
        little about the next one."""
        endpoint.consecutive_failures = 0
        if endpoint.healthy or not probe:
            return
        endpoint.consecutive_successes += 1
        if endpoint.consecutive_successes >= self.config.readmit_after:
            endpoint.healthy, endpoint.consecutive_successes = True, 0
            if self._on_readmit is not None:
                self._on_readmit(endpoint)

    def record_failure(self, endpoint: Endpoint) -> None:
        """A request or probe that failed: refused, timed out, 5xx, or cut short. The
        ``eject_after``-th in a row ejects the endpoint, and the attempts still waiting for
        its first byte are abandoned (their clients have seen nothing: the gateway retries
        them elsewhere at once instead of at their timeout)."""
        endpoint.consecutive_successes = 0
        endpoint.consecutive_failures += 1
        if endpoint.healthy and endpoint.consecutive_failures >= self.config.eject_after:
            endpoint.healthy = False
            for scope in self._awaiting.pop(endpoint, ()):
                scope.cancel()
            if self._on_eject is not None:
                self._on_eject(endpoint)

    # -- probes and scrapes -------------------------------------------------------------

    async def healthy_now(self, client: httpx.AsyncClient, url: str) -> bool:
        """One ``GET url/health``: True on a 200 within the probe timeout."""
        try:
            response = await client.get(url + "/health", timeout=self.config.probe_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        if await self.healthy_now(client, endpoint.url):
            self.record_success(endpoint, probe=True)
        else:
            self.record_failure(endpoint)

    async def scrape(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        """Read ``endpoint``'s ``/metrics``. A failed scrape leaves the old figures and their
        time, so they grow stale (routers treat stale metrics as saturated); it does not
        count against health, which the probes and the requests judge."""
        try:
            response = await client.get(endpoint.url + "/metrics",
                                        timeout=self.config.probe_timeout_s)
            response.raise_for_status()
            values = parse_backend_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            return
        for field, value in values.items():
            setattr(endpoint, field, value)
        endpoint.metrics_time = time.monotonic()
        endpoint.sent_since_scrape = 0

    async def start(self, client: httpx.AsyncClient) -> None:
        """Probe and scrape every backend once, then keep doing so in the background.

        A backend that fails its first probe starts ejected and is admitted after
        ``readmit_after`` good probes, as vllm-router waits for a worker's health before it
        routes to it. Each backend gets its own scrape and probe loops, so one that hangs
        until the timeout delays nobody else's figures.
        """
        self._client = client
        first = await asyncio.gather(*(self.healthy_now(client, e.url) for e in self.endpoints))
        for endpoint, ok in zip(self.endpoints, first, strict=True):
            endpoint.healthy = ok
        await asyncio.gather(*(self.scrape(client, e) for e in self.endpoints))
        for endpoint in self.endpoints:
            self._watch(endpoint)

    async def stop(self) -> None:
        tasks = [task for pair in self._watchers.values() for task in pair]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()
        self._client = None

    def _watch(self, endpoint: Endpoint) -> None:
        every = self._every
        self._watchers[endpoint] = (
            asyncio.create_task(every(self.config.scrape_interval_s, self.scrape, endpoint)),
            asyncio.create_task(every(self.config.probe_interval_s, self.probe, endpoint)))

    async def _every(self, interval_s: float, visit, endpoint: Endpoint) -> None:
        """``visit(client, endpoint)`` every ``interval_s`` seconds, start to start."""
        while True:
            started = time.monotonic()
            await visit(self._client, endpoint)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
