"""What the servers say a load did: the backends' own counters and the gateway's view
(chapter 5, :ref:`ch05-backend-dies`).

A load's effect is read from the servers, not from the client, so the same numbers come out
whichever router stood in front: each backend's requests finished and prefix-cache counters
(:class:`BackendCounters`, vLLM's names), read before and after a run; and ``labkit
gateway``'s own ``/workers`` and counters (:func:`gateway_workers`, :func:`gateway_metrics`).
Every ``/metrics`` page is read with :mod:`labkit.http.metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from labkit.checks import ParameterError
from labkit.http.metrics import sample_totals, totals_by_label

#: The samples :class:`BackendCounters` reads (vLLM's names), and its field for each.
COUNTED = {"vllm:e2e_request_latency_seconds_count": "requests",
           "vllm:prefix_cache_queries_total": "prefix_cache_queries",
           "vllm:prefix_cache_hits_total": "prefix_cache_hits"}


@dataclass(frozen=True)
class BackendCounters:
    """Counters from one backend's ``/metrics``, vLLM's names (chapter 5).

    ``requests``: requests finished (``vllm:e2e_request_latency_seconds_count``; vLLM's
    histogram and ``labkit serve``'s alike); ``prefix_cache_queries`` and
    ``prefix_cache_hits``: prompt tokens looked up in, and found in, its prefix cache
    (``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``). Counters start at 0 when
    the server starts: take both readings of a difference between restarts.
    """

    url: str
    requests: float
    prefix_cache_queries: float
    prefix_cache_hits: float

    def since(self, before: BackendCounters) -> BackendCounters:
        """What happened between the reading ``before`` and this one."""
        if before.url != self.url:
            raise ParameterError("before", f"before is a reading of {before.url}, "
                                           f"not of {self.url}")
        return BackendCounters(self.url, self.requests - before.requests,
                               self.prefix_cache_queries - before.prefix_cache_queries,
                               self.prefix_cache_hits - before.prefix_cache_hits)


def parse_counters(url: str, metrics_text: str) -> BackendCounters:
    """:class:`BackendCounters` from a ``/metrics`` page (summed over label sets: vLLM
    labels each engine core separately); a counter the page lacks reads 0."""
    totals = sample_totals(metrics_text, COUNTED)
    return BackendCounters(url, **{field: totals.get(name, 0.0)
                                   for name, field in COUNTED.items()})


def read_counters(urls: Sequence[str], timeout_s: float = 10.0) -> list[BackendCounters]:
    """Each backend's :class:`BackendCounters`, read now from its ``/metrics``."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        return [parse_counters(url, client.get(url + "/metrics").raise_for_status().text)
                for url in urls]


def fleet_hit_rate(deltas: Sequence[BackendCounters]) -> float:
    """The fleet's prefix-cache hit rate: prompt tokens found in some backend's cache over
    prompt tokens looked up, all backends together (chapter 5)."""
    queries = sum(d.prefix_cache_queries for d in deltas)
    if queries <= 0:
        raise ParameterError("deltas", "no prompt token was looked up in these readings")
    return sum(d.prefix_cache_hits for d in deltas) / queries


def gateway_workers(base_url: str) -> dict[str, dict]:
    """``labkit gateway``'s ``GET /workers`` keyed by backend URL: each backend's health,
    open requests and scraped load as the gateway sees them."""
    answer = httpx.get(base_url + "/workers", timeout=10, trust_env=False).raise_for_status()
    return {worker["url"]: worker for worker in answer.json()["workers"]}


def gateway_metrics(base_url: str) -> dict[str, dict[str, float]]:
    """``labkit gateway``'s own counters, ``{sample name: {backend URL: value}}``, e.g.
    ``["labkit_gateway_ejections_total"][url]``."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).raise_for_status().text
    return totals_by_label(text, "backend")
