"""Endpoint choice as a pipeline: filters, then weighted scorers, then a picker
(:ref:`ch05-choosing-backend`).

The stages live in :mod:`labkit.gateway.plugins`; this module assembles them into the
strategies the gateway offers.

Every strategy the gateway offers is the same three steps, the design of the Kubernetes Gateway
API Inference Extension's endpoint picker (EPP), now maintained in llm-d's inference scheduler
(github.com/llm-d/llm-d-inference-scheduler, whose Go module is now ``llm-d-router``; we read
commit 520af478 of 2026-05-17, and kubernetes-sigs/gateway-api-inference-extension v1.3.1 of
2026-02-19 before the move):

1. **filters** drop endpoints that may not or should not take the request (ejected, draining,
   saturated);
2. **scorers** give each remaining endpoint a score in [0, 1]; the pipeline adds them up, each
   times its weight (clamped to [0, 1] first, as ``enforceScoreRange`` in
   ``pkg/epp/scheduling/scheduler_profile.go`` does; a score that is not a finite number
   counts as 0);
3. a **picker** chooses one endpoint from the totals.

The routers only read :class:`~labkit.gateway.endpoints.Endpoint` records that the proxy keeps
current; they do no I/O, and ``now`` (``time.monotonic()`` seconds) is passed in, so tests
drive them with a fake clock. Randomness comes from one ``random.Random(seed)`` per router.
They are not thread-safe: the proxy calls them from its one event loop.

What the tutorial's ``InferenceGateway.select_instance`` gets wrong, and what we do instead:

- round robin is ``request_count % len(available)``: when ``available`` shrinks or grows, the
  index lands on a different instance and some get two turns in a row while others are
  skipped. :class:`~labkit.gateway.plugins.RoundRobinPicker` gives the turn to the endpoint
  picked least recently, so any two endpoints that stay routable alternate, whatever happens
  to the others;
- "weighted" is not weighted by anything the operator sets: it is ``min`` of ``0.6 * load_ratio
  + 0.4 * avg_latency_ms / 1000``, a dimensionless ratio added to seconds (in milliseconds the
  same formula would mean something else), with latency starting at 0.0 so an instance never
  used looks fastest, ties always going to the first instance, and every request that arrives
  before the numbers change going to the same one. Our ``weighted`` sends each endpoint a share
  of traffic proportional to ``Endpoint.weight`` (a weighted-random picker);
- least latency takes ``min`` over an average that starts at 0 ms, so it explores new instances
  only by accident, and the EWMA then takes many requests to climb from 0 to the truth. Ours
  tries endpoints of unknown latency first, explicitly
  (:class:`~labkit.gateway.plugins.UnknownLatencyFirstFilter`).

Strategies (:func:`make_router`), each a :class:`Pipeline`:

=================  ======================================================================
round_robin        routable -> (no scorer) -> least recently picked
least_requests     routable -> fewest ``in_flight`` -> max score, random tie-break
power_of_two       routable -> two random distinct -> fewest ``in_flight`` -> max score
consistent_hash    routable -> hash ring on the session (160 virtual nodes per endpoint)
least_latency      routable -> unknown TTFT first -> lowest ``ttft_ewma_s`` -> max score
weighted           routable -> ``weight`` / max weight -> weighted random
endpoint_picker    routable -> saturation detector -> queue x2 + KV cache x2 + prefix x3
                   -> max score (the EPP's default profile)
prefix_aware       the same with the prefix scorer's weight raised from 3 to 5
=================  ======================================================================
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields

from labkit.checks import ParameterError, in_range
from labkit.gateway.endpoints import Endpoint, NoEndpointError, RoutingRequest
from labkit.gateway.plugins import (
    KV_CACHE_UTIL_THRESHOLD,
    METRICS_STALENESS_S,
    QUEUE_DEPTH_THRESHOLD,
    RETRY_AFTER_S,
    ConsistentHashPicker,
    Filter,
    InFlightScorer,
    KVCacheScorer,
    LatencyScorer,
    MaxScorePicker,
    Picker,
    PrefixCacheScorer,
    QueueScorer,
    RandomSubsetFilter,
    RoundRobinPicker,
    RoutableFilter,
    SaturationDetector,
    Scorer,
    UnknownLatencyFirstFilter,
    WeightScorer,
    WeightedRandomPicker,
)
from labkit.gateway.prefix_index import (
    DEFAULT_BLOCK_SIZE_CHARS,
    DEFAULT_CAPACITY_PER_ENDPOINT,
    DEFAULT_MAX_CHUNKS,
    PrefixIndex,
)

# The EPP's default scheduling profile: llm-d-inference-scheduler pkg/epp/config/loader/defaults.go
# (loadDefaultConfig, commit 520af478, 2026-05-17) and the inferencepool Helm chart of the
# Gateway API Inference Extension v1.3.1 (config/charts/inferencepool/templates/epp-config.yaml).
QUEUE_SCORER_WEIGHT = 2.0
KV_CACHE_SCORER_WEIGHT = 2.0
PREFIX_SCORER_WEIGHT = 3.0
# prefix_aware: a full prefix match (5) outweighs the largest load difference the other two
# scorers can express together (2 + 2 = 4); a partial match still loses to a big load gap. Ours,
# not upstream's: llm-d's own sample configs raise it too (deploy/config/
# epp-precise-prefix-cache-config.yaml weighs prefix 2 against queue 1 and KV cache 1).
PREFIX_AWARE_PREFIX_WEIGHT = 5.0




# --- the pipeline -------------------------------------------------------------------------

class Router(ABC):
    """What the proxy calls: ``pick`` an endpoint, then ``record`` where the request went."""

    name: str

    @abstractmethod
    def pick(self, request: RoutingRequest, endpoints: Sequence[Endpoint],
             now: float) -> Endpoint:
        """Choose one routable endpoint.

        Raises :class:`~labkit.gateway.NoEndpointError` when none is routable (none healthy, or
        all draining), :class:`~labkit.gateway.SaturatedError` (with ``retry_after_s``) when the
        strategy sheds load.
        """

    def record(self, request: RoutingRequest,  # noqa: B027 - stateless routers learn nothing
               endpoint: Endpoint) -> None:
        """Called once the request was sent to ``endpoint`` (the prefix index learns here)."""

    def forget(self, url: str) -> None:  # noqa: B027 - stateless routers keep nothing
        """Drop what was learned about ``url`` (it left, or came back with an empty cache)."""


class Pipeline(Router):
    """Filters, then weighted scorers, then a picker: one routing strategy (chapter 5)."""

    def __init__(self, name: str, filters: Sequence[Filter],
                 scorers: Sequence[tuple[Scorer, float]], picker: Picker) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple((scorer, in_range(f"{scorer.name} weight", weight, 0))
                             for scorer, weight in scorers)
        self.picker = picker

    def scored(self, request: RoutingRequest, endpoints: Sequence[Endpoint],
               now: float) -> list[tuple[Endpoint, float]]:
        """The candidates that pass every filter, each with its weighted total score."""
        candidates = list(endpoints)
        for stage in self.filters:
            if not candidates:
                break
            candidates = stage.filter(request, candidates, now)
        if not candidates:
            raise NoEndpointError(f"no routable endpoint among {len(endpoints)} "
                                  "(each is unhealthy or draining)")
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for i, score in enumerate(scorer.score(request, candidates, now)):
                # A score that is not a number says nothing: it counts as 0, as unknown
                # figures do in every scorer (NaN would otherwise win or lose every compare).
                totals[i] += weight * (min(max(score, 0.0), 1.0) if math.isfinite(score)
                                       else 0.0)
        return list(zip(candidates, totals, strict=True))

    def pick(self, request: RoutingRequest, endpoints: Sequence[Endpoint],
             now: float) -> Endpoint:
        return self.picker.pick(request, self.scored(request, endpoints, now))

    def record(self, request: RoutingRequest, endpoint: Endpoint) -> None:
        for scorer, _ in self.scorers:
            scorer.record(request, endpoint)

    def forget(self, url: str) -> None:
        for scorer, _ in self.scorers:
            scorer.forget(url)


@dataclass(frozen=True)
class SchedulerConfig:
    """The options of ``endpoint_picker`` and ``prefix_aware``, with upstream's defaults.

    Weights are the scheduling profile's; ``picker`` is ``"max_score"`` (upstream's default)
    or ``"weighted_random"``; the thresholds are
    :class:`~labkit.gateway.plugins.SaturationDetector`'s; the last three size the
    :class:`~labkit.gateway.prefix_index.PrefixIndex`.
    """

    queue_weight: float = QUEUE_SCORER_WEIGHT
    kv_cache_weight: float = KV_CACHE_SCORER_WEIGHT
    prefix_weight: float = PREFIX_SCORER_WEIGHT
    picker: str = "max_score"
    queue_depth_threshold: int = QUEUE_DEPTH_THRESHOLD
    kv_cache_threshold: float = KV_CACHE_UTIL_THRESHOLD
    metrics_staleness_s: float = METRICS_STALENESS_S
    retry_after_s: float = RETRY_AFTER_S
    block_size_chars: int = DEFAULT_BLOCK_SIZE_CHARS
    max_chunks: int = DEFAULT_MAX_CHUNKS
    capacity_per_endpoint: int = DEFAULT_CAPACITY_PER_ENDPOINT

    def __post_init__(self) -> None:
        for name in ("queue_weight", "kv_cache_weight", "prefix_weight"):
            in_range(name, getattr(self, name), 0)
        if self.picker not in _PICKERS:
            raise ParameterError("picker", f"picker must be one of {', '.join(_PICKERS)}, "
                                 f"got {self.picker!r}")

    def pipeline(self, name: str, rng: random.Random) -> Pipeline:
        """The EPP's scheduling profile with these settings."""
        detector = SaturationDetector(self.queue_depth_threshold, self.kv_cache_threshold,
                                      self.metrics_staleness_s, self.retry_after_s)
        index = PrefixIndex(block_size_chars=self.block_size_chars, max_chunks=self.max_chunks,
                            capacity_per_endpoint=self.capacity_per_endpoint)
        return Pipeline(name, [RoutableFilter(), detector],
                        [(QueueScorer(), self.queue_weight),
                         (KVCacheScorer(), self.kv_cache_weight),
                         (PrefixCacheScorer(index), self.prefix_weight)],
                        _PICKERS[self.picker](rng))


_PICKERS = {"max_score": MaxScorePicker, "weighted_random": WeightedRandomPicker}
_SCHEDULER_OPTIONS = tuple(f.name for f in fields(SchedulerConfig))
_OPTIONS: dict[str, tuple[str, ...]] = {
    "round_robin": (),
    "least_requests": (),
    "power_of_two": (),
    "consistent_hash": ("virtual_nodes",),
    "least_latency": (),
    "weighted": (),
    "endpoint_picker": _SCHEDULER_OPTIONS,
    "prefix_aware": _SCHEDULER_OPTIONS,
}
STRATEGIES: tuple[str, ...] = tuple(_OPTIONS)


def make_router(strategy: str, *, seed: int | None = None, **options) -> Router:
    """A new router for ``strategy`` (one of ``STRATEGIES``), chapter 5.

    ``seed`` seeds the router's one ``random.Random`` (tie-breaks, random candidates), so runs
    repeat. Options: ``consistent_hash`` takes ``virtual_nodes`` (default 160);
    ``endpoint_picker`` and ``prefix_aware`` take the fields of
    :class:`~labkit.gateway.routing.SchedulerConfig`; the others take none. Raises
    :class:`~labkit.checks.ParameterError` naming a bad strategy or option.
    """
    if strategy not in _OPTIONS:
        raise ParameterError("strategy", f"strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ParameterError("seed", f"seed must be an integer or None, got {seed!r}")
    for option in options:
        if option not in _OPTIONS[strategy]:
            allowed = ", ".join(_OPTIONS[strategy]) or "none"
            raise ParameterError(option, f"{strategy} has no option {option!r} "
                                 f"(its options: {allowed})")
    rng = random.Random(seed)
    routable = RoutableFilter()
    if strategy == "round_robin":
        return Pipeline(strategy, [routable], [], RoundRobinPicker())
    if strategy == "least_requests":
        return Pipeline(strategy, [routable], [(InFlightScorer(), 1.0)], MaxScorePicker(rng))
    if strategy == "power_of_two":
        return Pipeline(strategy, [routable, RandomSubsetFilter(2, rng)],
                        [(InFlightScorer(), 1.0)], MaxScorePicker(rng))
    if strategy == "consistent_hash":
        return Pipeline(strategy, [routable], [], ConsistentHashPicker(**options))
    if strategy == "least_latency":
        return Pipeline(strategy, [routable, UnknownLatencyFirstFilter()],
                        [(LatencyScorer(), 1.0)], MaxScorePicker(rng))
    if strategy == "weighted":
        return Pipeline(strategy, [routable], [(WeightScorer(), 1.0)], WeightedRandomPicker(rng))
    if strategy == "prefix_aware":
        options = {"prefix_weight": PREFIX_AWARE_PREFIX_WEIGHT, **options}
    return SchedulerConfig(**options).pipeline(strategy, rng)
