"""The stages a routing pipeline is built from: filters, scorers and pickers
(:ref:`ch05-choosing-backend`).

Each is one small class after a plugin of the Kubernetes Gateway API Inference Extension's
endpoint picker, now maintained in llm-d's router (the sources are cited on each), or one of
the classic load-balancing strategies cut into the same shape. :mod:`labkit.gateway.routing`
assembles them into the strategies the gateway offers.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.endpoints import Endpoint, RoutingRequest, SaturatedError
from labkit.gateway.prefix_index import (
    PrefixIndex,
)

# The utilization saturation detector: llm-d-inference-scheduler
# pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/config.go (520af478),
# the same values as gateway-api-inference-extension v1.3.1
# pkg/epp/saturationdetector/framework/plugins/utilizationdetector/config.go.
QUEUE_DEPTH_THRESHOLD = 5        # waiting requests
KV_CACHE_UTIL_THRESHOLD = 0.8    # fraction of the KV cache in use
METRICS_STALENESS_S = 0.2        # 200 ms; upstream scrapes every 50 ms (RefreshMetricsInterval,
#                                  pkg/epp/server/options.go), so stale = four missed scrapes
RETRY_AFTER_S = 1.0              # ours: Retry-After carries whole seconds, 1 is the least hint

# vllm-router: VIRTUAL_NODES_PER_WORKER in src/policies/consistent_hash.rs (vllm-project/router,
# file version 080589a0).
VIRTUAL_NODES = 160


def _hash64(text: str) -> int:
    """A stable 64-bit hash (BLAKE2b), the same in every process, unlike ``hash()``."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _lower_is_better(values: Sequence[float | None]) -> list[float]:
    """Min-max scores: the smallest value 1, the largest 0, all equal 1, unknown (None) 0.

    The shape of the EPP's queue scorer (``(max - x) / (max - min)``, ``scorer/queuedepth/
    queue.go``): relative, so it says who is least loaded, not how loaded.
    """
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low, high = min(known), max(known)
    return [0.0 if v is None else 1.0 if high == low else (high - v) / (high - low)
            for v in values]


# --- the three kinds of stage -------------------------------------------------------------

class Filter(ABC):
    """Keeps the endpoints that may take the request (chapter 5)."""

    name: ClassVar[str]

    @abstractmethod
    def filter(self, request: RoutingRequest, endpoints: list[Endpoint],
               now: float) -> list[Endpoint]:
        """The endpoints that pass, in their order (a non-empty input may come out empty)."""


class Scorer(ABC):
    """Gives each candidate a score in [0, 1], higher is better (chapter 5)."""

    name: ClassVar[str]

    @abstractmethod
    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        """One score per endpoint, in the same order."""

    def record(self, request: RoutingRequest,  # noqa: B027 - stateless scorers learn nothing
               endpoint: Endpoint) -> None:
        """Learn that ``request`` went to ``endpoint`` (stateless scorers ignore it)."""

    def forget(self, url: str) -> None:  # noqa: B027 - stateless scorers keep nothing
        """Drop what was learned about ``url`` (stateless scorers have nothing to drop)."""


class Picker(ABC):
    """Chooses one endpoint from the scored candidates (chapter 5)."""

    name: ClassVar[str]

    @abstractmethod
    def pick(self, request: RoutingRequest, scored: list[tuple[Endpoint, float]]) -> Endpoint:
        """One of the candidates; ``scored`` is never empty."""


# --- filters ------------------------------------------------------------------------------

class RoutableFilter(Filter):
    """Healthy and not draining (``Endpoint.routable``)."""

    name = "routable"

    def filter(self, request: RoutingRequest, endpoints: list[Endpoint],
               now: float) -> list[Endpoint]:
        return [e for e in endpoints if e.routable]


@dataclass
class SaturationDetector(Filter):
    """The EPP's utilization detector: drops saturated endpoints, sheds load when all are.

    An endpoint has capacity while ``num_requests_waiting < queue_depth_threshold`` and
    ``kv_cache_usage < kv_cache_threshold`` on metrics no older than ``metrics_staleness_s``;
    metrics that are missing or stale count as saturated, so that no traffic goes into "an
    unobservable black hole". This is llm-d's ``Detector.Filter`` (strict ``<``, headroom 0,
    ``saturationdetector/utilization/detector.go``); the Inference Extension v1.3.1 counted an
    endpoint saturated only above the thresholds (``>``), not at them. Where upstream then
    falls back to all endpoints and lets its flow controller queue the request, we shed it:
    every candidate saturated raises :class:`~labkit.gateway.SaturatedError`, the proxy's 429 with
    ``Retry-After``.

    The proxy must scrape each backend more often than ``metrics_staleness_s`` (upstream: every
    50 ms against 200 ms), or pass a larger value: otherwise every endpoint looks stale.
    """

    queue_depth_threshold: int = QUEUE_DEPTH_THRESHOLD
    kv_cache_threshold: float = KV_CACHE_UTIL_THRESHOLD
    metrics_staleness_s: float = METRICS_STALENESS_S
    retry_after_s: float = RETRY_AFTER_S
    name: ClassVar[str] = "saturation-detector"

    def __post_init__(self) -> None:
        positive_int("queue_depth_threshold", self.queue_depth_threshold)
        in_range("kv_cache_threshold", self.kv_cache_threshold, 0, 1, low_open=True)
        in_range("metrics_staleness_s", self.metrics_staleness_s, 0, low_open=True)
        in_range("retry_after_s", self.retry_after_s, 0, low_open=True)

    def saturated(self, endpoint: Endpoint, now: float) -> bool:
        """True when ``endpoint`` should get no new request now."""
        if (endpoint.metrics_age_s(now) > self.metrics_staleness_s
                or endpoint.num_requests_waiting is None or endpoint.kv_cache_usage is None):
            return True
        return (endpoint.num_requests_waiting >= self.queue_depth_threshold
                or endpoint.kv_cache_usage >= self.kv_cache_threshold)

    def filter(self, request: RoutingRequest, endpoints: list[Endpoint],
               now: float) -> list[Endpoint]:
        free = [e for e in endpoints if not self.saturated(e, now)]
        if not free:
            raise SaturatedError(
                f"all {len(endpoints)} routable endpoints are saturated (waiting requests >= "
                f"{self.queue_depth_threshold}, KV cache usage >= {self.kv_cache_threshold:g}, "
                f"or metrics older than {self.metrics_staleness_s:g} s)",
                retry_after_s=self.retry_after_s)
        return free


class UnknownLatencyFirstFilter(Filter):
    """Only the endpoints with no TTFT measured yet, if there are any: explore before exploiting."""

    name = "unknown-latency-first"

    def filter(self, request: RoutingRequest, endpoints: list[Endpoint],
               now: float) -> list[Endpoint]:
        unknown = [e for e in endpoints if e.ttft_ewma_s is None]
        return unknown or endpoints


class RandomSubsetFilter(Filter):
    """``k`` distinct endpoints drawn at random (all of them when there are no more than ``k``).

    With ``k = 2`` and a least-loaded scorer this is "the power of two choices" (Mitzenmacher,
    2001): almost the balance of asking every backend, at the cost of asking two.
    """

    name = "random-subset"

    def __init__(self, k: int, rng: random.Random) -> None:
        self.k = positive_int("k", k)
        self.rng = rng

    def filter(self, request: RoutingRequest, endpoints: list[Endpoint],
               now: float) -> list[Endpoint]:
        return list(endpoints) if len(endpoints) <= self.k else self.rng.sample(endpoints, self.k)


# --- scorers ------------------------------------------------------------------------------

class QueueScorer(Scorer):
    """The EPP's queue scorer: the shortest queue scores 1, the longest 0.

    ``(max - waiting) / (max - min)`` over the candidates, 1 for all when they are equal
    (llm-d ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``). Unknown: 0.
    Upstream reads the scraped ``vllm:num_requests_waiting`` alone, and its saturation
    detector's README warns that a burst between two scrapes piles onto the endpoint that
    still looks idle. Here the queue is :attr:`~labkit.gateway.Endpoint.expected_waiting`: the
    scraped one plus the requests this gateway sent since that scrape.
    """

    name = "queue-scorer"

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        return _lower_is_better([e.expected_waiting for e in endpoints])


class KVCacheScorer(Scorer):
    """The EPP's KV-cache-utilization scorer: ``1 - vllm:kv_cache_usage_perc``. Unknown: 0.

    Absolute, unlike the queue scorer (llm-d ``scorer/kvcacheutilization/kvcache_utilization.go``).
    """

    name = "kv-cache-utilization-scorer"

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        return [0.0 if e.kv_cache_usage is None else 1.0 - e.kv_cache_usage for e in endpoints]


class PrefixCacheScorer(Scorer):
    """The EPP's prefix-cache scorer: the share of the prompt's chunks an endpoint holds.

    ``matched leading chunks / total chunks`` from the gateway's own
    :class:`~labkit.gateway.prefix_index.PrefixIndex`, 0 for a prompt shorter than one chunk (llm-d
    ``scorer/prefix/plugin.go``). The index learns in
    :meth:`record`, once the proxy has sent the request, as upstream's ``PreRequest`` does.
    """

    name = "prefix-cache-scorer"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        total = self.index.num_chunks(request.prompt)
        if total == 0:
            return [0.0] * len(endpoints)
        matched = self.index.match(request.prompt, model=request.model)
        return [matched.get(e.url, 0) / total for e in endpoints]

    def record(self, request: RoutingRequest, endpoint: Endpoint) -> None:
        self.index.record(request.prompt, endpoint.url, model=request.model)

    def forget(self, url: str) -> None:
        self.index.remove(url)


class InFlightScorer(Scorer):
    """Fewest requests the gateway has open on the endpoint (``in_flight``) scores 1.

    The gateway's own count is exact and current, where scraped metrics lag by a scrape.
    """

    name = "in-flight-scorer"

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        return _lower_is_better([e.in_flight for e in endpoints])


class LatencyScorer(Scorer):
    """Lowest time-to-first-token average (``ttft_ewma_s``) scores 1, highest 0. Unknown: 0."""

    name = "latency-scorer"

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        return _lower_is_better([e.ttft_ewma_s for e in endpoints])


class WeightScorer(Scorer):
    """``weight / max weight``: the operator's share for each endpoint (e.g. its GPU count)."""

    name = "weight-scorer"

    def score(self, request: RoutingRequest, endpoints: list[Endpoint],
              now: float) -> list[float]:
        weights = [in_range("weight", e.weight, 0) for e in endpoints]
        top = max(weights)
        return [w / top if top > 0 else 0.0 for w in weights]


# --- pickers ------------------------------------------------------------------------------

class MaxScorePicker(Picker):
    """The highest total wins; ties are broken at random.

    llm-d ``scheduling/picker/maxscore/picker.go`` shuffles before a stable sort for the same
    effect: without it, equal scores always send traffic to the first endpoint in the list.
    """

    name = "max-score-picker"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, request: RoutingRequest, scored: list[tuple[Endpoint, float]]) -> Endpoint:
        best = max(score for _, score in scored)
        return self.rng.choice([e for e, score in scored if score == best])


class WeightedRandomPicker(Picker):
    """Each candidate with probability proportional to its total; uniform if all are 0.

    Weighted sampling by A-Res (Efraimidis and Spirakis, 2006), as llm-d's
    ``scheduling/picker/weightedrandom/picker.go``: key ``u ** (1 / score)`` with ``u``
    uniform in (0, 1), the largest key wins; a zero score never wins unless all are zero.
    """

    name = "weighted-random-picker"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, request: RoutingRequest, scored: list[tuple[Endpoint, float]]) -> Endpoint:
        if all(score <= 0 for _, score in scored):
            return self.rng.choice([e for e, _ in scored])
        best, best_key = scored[0][0], -1.0
        for endpoint, score in scored:
            if score <= 0:
                continue
            u = self.rng.random() or math.ulp(0.0)  # keep u > 0 so that the key is > 0
            key = u ** (1.0 / score)
            if key > best_key:
                best, best_key = endpoint, key
        return best


class RoundRobinPicker(Picker):
    """The candidate picked least recently (never picked first, in list order).

    With a fixed set this is plain round robin. When endpoints leave and come back it stays
    fair: between two picks of one endpoint, every other endpoint that was a candidate all along
    is picked once, so their counts never differ by more than one.
    """

    name = "round-robin-picker"

    def __init__(self) -> None:
        self._last_pick: dict[str, int] = {}  # url -> turn number of its latest pick
        self._turn = 0

    def pick(self, request: RoutingRequest, scored: list[tuple[Endpoint, float]]) -> Endpoint:
        endpoint = min((e for e, _ in scored), key=lambda e: self._last_pick.get(e.url, -1))
        self._turn += 1
        self._last_pick[endpoint.url] = self._turn
        return endpoint


class HashRing:
    """Consistent hashing: each URL at ``virtual_nodes`` points on a 64-bit circle.

    A key goes to the first point clockwise from its own hash. Removing a URL removes only its
    points, so only the keys that were on it move (to their next point); everything else stays
    (Karger et al., 1997). Many virtual nodes per URL even out the arcs each one owns.
    """

    def __init__(self, urls: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        positive_int("virtual_nodes", virtual_nodes)
        if not urls:
            raise ParameterError("urls", "urls must name at least one endpoint, got none")
        points = sorted((_hash64(f"{url}#{i}"), url) for url in set(urls)
                        for i in range(virtual_nodes))
        self._points = [p for p, _ in points]
        self._urls = [url for _, url in points]

    def lookup(self, key: str) -> str:
        """The URL that owns ``key``."""
        i = bisect.bisect_left(self._points, _hash64(key))
        return self._urls[i % len(self._urls)]  # past the last point: wrap to the first


class ConsistentHashPicker(Picker):
    """Session affinity: the same session goes to the same endpoint while it stays routable.

    The key is ``RoutingRequest.session`` (the session header), or the prompt when there is
    none, as vllm-router falls back to the request's text (``src/policies/hash_key.rs``). The
    ring holds the routable candidates only, so an ejected endpoint's sessions spread over the
    others; vllm-router's ring keeps every worker and sends all of an unhealthy worker's keys to
    the first healthy one.
    """

    name = "consistent-hash-picker"

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.virtual_nodes = positive_int("virtual_nodes", virtual_nodes)
        self._ring: HashRing | None = None
        self._ring_urls: frozenset[str] = frozenset()

    def pick(self, request: RoutingRequest, scored: list[tuple[Endpoint, float]]) -> Endpoint:
        by_url = {e.url: e for e, _ in scored}
        urls = frozenset(by_url)
        if self._ring is None or urls != self._ring_urls:  # rebuild only when the set changes
            self._ring, self._ring_urls = HashRing(sorted(urls), self.virtual_nodes), urls
        return by_url[self._ring.lookup(request.session or request.prompt)]
