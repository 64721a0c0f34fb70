"""The gateway's backend pool: who is up, how loaded, how fast
(:ref:`ch05-choosing-backend`, :ref:`ch05-backend-dies`).

One :class:`~labkit.gateway.endpoints.Endpoint` per backend server, kept current three ways:

* **scraped load**: every ``scrape_interval_s`` the pool reads each backend's ``/metrics``
  (vLLM's names, which ``labkit serve`` exports too: ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and the prefix-cache counters).
  The Gateway API Inference Extension's endpoint picker scrapes every 50 ms by default
  (``defaultRefreshMetricsInterval``, kubernetes-sigs/gateway-api-inference-extension,
  ``cmd/epp/runner/options.go``, main branch 2025), because queue depth and KV-cache use
  change within a second; we take the same default.
* **health**: active ``GET /health`` probes every ``probe_interval_s``, plus passive counting
  of the requests the gateway forwards (a refused connection, a timeout, a 5xx, a stream
  cut short). ``eject_after`` consecutive failures eject a backend; while ejected it is only
  probed, and ``readmit_after`` consecutive successful probes bring it back. The defaults,
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
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.endpoints import Endpoint

#: The Inference Extension's endpoint picker scrapes every 50 ms (module docstring); we scrape
#: every 250 ms: on a 2-core laptop a busy teaching server can take 300 ms to answer
#: ``/metrics``, and three backends scraped 20 times a second take a visible share of a core.
DEFAULT_SCRAPE_INTERVAL_S = 0.25
#: Metrics older than this many scrape intervals are stale (upstream: 200 ms / 50 ms = 4).
STALE_AFTER_INTERVALS = 4
#: Ours: vllm-router probes every 60 s (``health_check_interval_secs``, 0.1.17); on one
#: machine a loopback probe costs well under a millisecond, and once a second lets a lab
#: watch a dead backend leave and come back within seconds.
DEFAULT_PROBE_INTERVAL_S = 1.0
#: vllm-router's ``health_check_timeout_secs`` (0.1.17); scrapes get the same bound.
DEFAULT_PROBE_TIMEOUT_S = 5.0
#: vllm-router's ``health_failure_threshold`` and ``health_success_threshold`` (0.1.17).
DEFAULT_EJECT_AFTER, DEFAULT_READMIT_AFTER = 3, 2

#: Weight of the newest sample in the TTFT average: ``ewma = a * sample + (1 - a) * ewma``.
#: With a = 0.25 a sample's weight halves every ln 2 / -ln 0.75 = 2.4 requests, so a backend
#: that slows down is noticed within a handful of requests, while one slow outlier moves the
#: average only a quarter of the way towards it.
TTFT_EWMA_ALPHA = 0.25

#: The backend metric families the pool reads (vLLM's names), and the Endpoint field of each.
SCRAPED_METRICS = {
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
}


def normalize_url(url: str) -> str:
    """``url`` as the pool keys it, without a trailing slash (chapter 5). An
    ``http(s)://host[:port]`` is required; anything else raises
    :class:`~labkit.checks.ParameterError`."""
    parts = urlsplit(url.strip()) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ParameterError("url", f"url must be http://host:port or https://host:port, "
                                    f"got {url!r}")
    return url.strip().rstrip("/")


def parse_backend_metrics(text: str) -> dict[str, float]:
    """The load figures in one ``/metrics`` page, keyed by :class:`Endpoint` field name
    (chapter 5).

    Counts and counters are summed over label sets (vLLM labels each data-parallel engine
    separately; the server's total is their sum); the KV-cache usage, a fraction, is their
    mean. A family the page lacks is left out. Only the lines of the families we read go to
    the parser: the whole page of a ``labkit serve`` takes the parser about 1.5 ms, those
    lines a tenth of that, and the pool parses a page per backend 20 times a second.
    """
    wanted = tuple(SCRAPED_METRICS)
    # "# HELP name ..." and "# TYPE name ..." carry the name after 7 characters.
    lines = [line for line in text.splitlines()
             if (line[7:] if line.startswith("#") else line).startswith(wanted)]
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        if family.name not in SCRAPED_METRICS:
            continue  # e.g. a counter's ``_created`` companion gauge
        samples = [s.value for s in family.samples
                   if s.name == family.name or s.name == family.name + "_total"]
        if samples:
            values[SCRAPED_METRICS[family.name]] = samples
    return {field: (sum(v) / len(v) if field == "kv_cache_usage" else sum(v))
            for field, v in values.items()}


class BackendPool:
    """The backends behind one gateway, their health and their load (chapter 5).

    ``on_eject(endpoint)`` and ``on_readmit(endpoint)`` are called on each transition (the
    gateway counts them in its own metrics). :meth:`start` runs the scrape and probe loops
    on the running event loop with the given client; ``stop()`` ends them. Not
    thread-safe: everything runs on the gateway's one event loop.
    """

    def __init__(self, urls: Sequence[str], *,
                 scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
                 probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 eject_after: int = DEFAULT_EJECT_AFTER,
                 readmit_after: int = DEFAULT_READMIT_AFTER,
                 on_eject: Callable[[Endpoint], None] | None = None,
                 on_readmit: Callable[[Endpoint], None] | None = None) -> None:
        self.scrape_interval_s = in_range("scrape_interval_s", scrape_interval_s, 0,
                                          low_open=True)
        self.probe_interval_s = in_range("probe_interval_s", probe_interval_s, 0,
                                         low_open=True)
        self.probe_timeout_s = in_range("probe_timeout_s", probe_timeout_s, 0, low_open=True)
        self.eject_after = positive_int("eject_after", eject_after)
        self.readmit_after = positive_int("readmit_after", readmit_after)
        self._on_eject, self._on_readmit = on_eject, on_readmit
        self.endpoints: list[Endpoint] = []
        self._client: httpx.AsyncClient | None = None
        self._watchers: dict[Endpoint, tuple[asyncio.Task, asyncio.Task]] = {}
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
        for task in self._watchers.pop(endpoint, ()):
            task.cancel()

    def routable(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.routable]

    async def drain(self, endpoint: Endpoint, timeout_s: float) -> int:
        """Stop new requests to ``endpoint`` and wait up to ``timeout_s`` seconds for its open
        ones to finish; returns how many are still open (0 when it drained)."""
        endpoint.draining = True
        deadline = time.monotonic() + timeout_s
        while endpoint.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return endpoint.in_flight

    # -- the gateway's own accounting ---------------------------------------------------

    @staticmethod
    def opened(endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.sent_since_scrape += 1

    @staticmethod
    def closed(endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1

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
        if endpoint.consecutive_successes >= self.readmit_after:
            endpoint.healthy, endpoint.consecutive_successes = True, 0
            if self._on_readmit is not None:
                self._on_readmit(endpoint)

    def record_failure(self, endpoint: Endpoint) -> None:
        """A request or probe that failed: refused, timed out, 5xx, or cut short."""
        endpoint.consecutive_successes = 0
        endpoint.consecutive_failures += 1
        if endpoint.healthy and endpoint.consecutive_failures >= self.eject_after:
            endpoint.healthy = False
            if self._on_eject is not None:
                self._on_eject(endpoint)

    # -- probes and scrapes -------------------------------------------------------------

    async def healthy_now(self, client: httpx.AsyncClient, url: str) -> bool:
        """One ``GET url/health``: True on a 200 within the probe timeout."""
        try:
            response = await client.get(url + "/health", timeout=self.probe_timeout_s)
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
            response = await client.get(endpoint.url + "/metrics", timeout=self.probe_timeout_s)
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
        self._watchers[endpoint] = (
            asyncio.create_task(self._every(self.scrape_interval_s, self.scrape, endpoint)),
            asyncio.create_task(self._every(self.probe_interval_s, self.probe, endpoint)))

    async def _every(self, interval_s: float, visit, endpoint: Endpoint) -> None:
        """``visit(client, endpoint)`` every ``interval_s`` seconds, start to start."""
        while True:
            started = time.monotonic()
            await visit(self._client, endpoint)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
