"""What one engine step did, as vLLM's ``SchedulerStats`` and ``IterationStats`` record it
(chapter 2, :ref:`ch08-metrics`).

vLLM's engine core hands its metrics loggers two records per step
(``vllm/v1/metrics/stats.py``): the scheduler's state after the step (requests running and
waiting, KV-cache usage, the step's prefix-cache lookups) and what the step produced (prompt
and generated tokens, preemptions, the latencies of the tokens it emitted). The teaching
engine builds the same two records (:meth:`~labkit.engine.LLMEngine.step` leaves them in
``last_stats``), and :class:`~labkit.engine.metrics.EngineMetrics` turns them into
Prometheus series without reading the engine's internals. Counts are for the one step, not
running totals: the metrics add them up, as vLLM's loggers do. Times are in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.scheduling import Request, Scheduler


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups in one step, in tokens (vLLM's ``PrefixCacheStats``): ``queries``
    prompt tokens looked up, ``hits`` of them found cached."""

    queries: int = 0
    hits: int = 0


#: A step that looked nothing up (an abort, a sleep).
NO_LOOKUPS = PrefixCacheStats()


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler after a step (vLLM's ``SchedulerStats``; its field names)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of blocks held by requests, 0..1
    prefix_cache_stats: PrefixCacheStats = NO_LOOKUPS

    @classmethod
    def of(cls, scheduler: Scheduler,
           prefix_cache_stats: PrefixCacheStats = NO_LOOKUPS) -> SchedulerStats:
        """The state of ``scheduler`` now, with the lookups of the step just done."""
        return cls(len(scheduler.running), len(scheduler.waiting), scheduler.kv_cache.usage,
                   prefix_cache_stats)


@dataclass
class IterationStats:
    """What one step produced (vLLM's ``IterationStats``; its field names).

    ``num_prompt_tokens`` counts the prompts whose first token came out this step, cached
    tokens included, as vLLM does; each token a request emits adds one generated token and one
    latency: the time to first token for its first, the inter-token latency for the others,
    and the end-to-end latency of a request it finishes.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    e2e_latencies_iter: list[float] = field(default_factory=list)  # vLLM: finished_requests

    def record_token(self, request: Request, num_tokens: int = 1) -> None:
        """Account for the ``num_tokens`` tokens ``request`` has just emitted (its last in
        ``token_times``; several when a step verified drafts). As in vLLM, one step gives
        a request one latency, however many tokens it emitted."""
        times = request.token_times
        self.num_generation_tokens += num_tokens
        if len(times) == num_tokens:
            self.time_to_first_tokens_iter.append(times[0] - request.arrival_time)
        else:
            self.inter_token_latencies_iter.append(times[-1] - times[-1 - num_tokens])
        if request.is_finished:
            self.e2e_latencies_iter.append(request.finish_time - request.arrival_time)


@dataclass
class SpecDecodingStats:
    """Speculative decoding in one step (vLLM's ``SpecDecodingStats``, its field names):
    requests that verified drafts, the drafts, the accepted ones, and both by position
    (position ``i`` is the ``i``-th draft of a request; a draft is only accepted if every
    draft before it was)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        self.num_draft_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request verified ``num_draft_tokens`` drafts and kept the first
        ``num_accepted_tokens``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1


@dataclass(frozen=True)
class EngineStats:
    """The records of one step, as the engine hands them to its metrics (``spec_decoding``
    only from an engine that speculates)."""

    scheduler: SchedulerStats
    iteration: IterationStats = field(default_factory=IterationStats)
    spec_decoding: SpecDecodingStats | None = None
