"""What the gateway knows about each backend, and what one routing decision reads
(:ref:`ch05-choosing-backend`).

The proxy (:mod:`labkit.gateway.server`) owns one :class:`Endpoint` per backend and keeps it
current: its own count of open requests, the backend's ``/metrics`` scraped on an interval
(vLLM's metric names), health from probes and from failed requests. A router
(:mod:`labkit.gateway.routing`) only reads these records: it never does I/O, so every
strategy is tested without a server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The figures a backend reports (its ``/metrics``) or the gateway measures, and the range a
#: sane value lies in. A value outside it (``NaN``, infinite, a negative count, a KV-cache
#: usage above 1) says nothing true about the backend: the endpoint stores it as unknown
#: (``None``), exactly as if that scrape had not happened, so every filter and scorer treats
#: it as it treats a backend it has not heard from.
REPORTED_RANGES = {
    "num_requests_waiting": (0.0, math.inf),
    "num_requests_running": (0.0, math.inf),
    "kv_cache_usage": (0.0, 1.0),
    "prefix_cache_queries": (0.0, math.inf),
    "prefix_cache_hits": (0.0, math.inf),
    "ttft_ewma_s": (0.0, math.inf),
}


def known(field: str, value: float | None) -> float | None:
    """``value`` if it is a finite number within ``REPORTED_RANGES[field]``, else ``None``
    (unknown)."""
    low, high = REPORTED_RANGES[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None


@dataclass(eq=False)
class Endpoint:
    """One backend server as the gateway sees it. The reported figures
    (:data:`~labkit.gateway.endpoints.REPORTED_RANGES`) go through
    :func:`~labkit.gateway.endpoints.known` whenever they are set: a router never
    sees ``NaN`` or an impossible value, only a number or ``None``."""

    url: str                                 # base URL, e.g. "http://127.0.0.1:8001"
    weight: float = 1.0                      # for the weighted strategies
    healthy: bool = True                     # False while ejected
    draining: bool = False                   # finishing its streams, getting no new ones
    in_flight: int = 0                       # requests the gateway has open on it now
    # From the backend's /metrics (vLLM's names); None until the first successful scrape.
    num_requests_waiting: float | None = None  # vllm:num_requests_waiting
    num_requests_running: float | None = None  # vllm:num_requests_running
    kv_cache_usage: float | None = None        # vllm:kv_cache_usage_perc, a fraction in [0, 1]
    prefix_cache_queries: float | None = None  # vllm:prefix_cache_queries (tokens, a counter)
    prefix_cache_hits: float | None = None     # vllm:prefix_cache_hits (tokens, a counter)
    metrics_time: float | None = None          # time.monotonic() of that scrape
    sent_since_scrape: int = 0                 # requests the gateway sent it since then
    ttft_ewma_s: float | None = None           # the gateway's own TTFT average for it
    consecutive_failures: int = 0
    consecutive_successes: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        if name in REPORTED_RANGES:
            value = known(name, value)
        super().__setattr__(name, value)

    @property
    def routable(self) -> bool:
        """May get new requests: healthy and not draining."""
        return self.healthy and not self.draining

    @property
    def expected_waiting(self) -> float | None:
        """The scraped queue plus what the gateway sent since the scrape: until the next
        scrape, every router would otherwise see the same queue and send a whole burst to
        the one backend that looked emptiest."""
        if self.num_requests_waiting is None:
            return None
        return self.num_requests_waiting + self.sent_since_scrape

    def metrics_age_s(self, now: float) -> float:
        """Seconds since the last successful scrape (infinite before the first)."""
        return float("inf") if self.metrics_time is None else now - self.metrics_time


@dataclass(frozen=True)
class RoutingRequest:
    """What a router may look at in one request."""

    model: str | None
    prompt: str                  # the prompt, or the chat messages' contents joined in order
    session: str | None = None   # the session-affinity header's value, if sent
    stream: bool = False         # the client asked for a stream ("stream": true)


class NoEndpointError(Exception):
    """No backend may take the request (none healthy, or all draining): HTTP 503."""


class SaturatedError(Exception):
    """Every candidate backend is saturated: shed the request (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
