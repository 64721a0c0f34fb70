"""Continuous batching with one token budget, after vLLM v1's scheduler (chapter 3.2).

Every step the scheduler hands the model a batch of (request, number of new tokens): running
requests first (one token for a decode, a chunk for an unfinished prefill), then waiting ones,
until ``max_num_batched_tokens`` or ``max_num_seqs`` is reached. Prefill and decode share the
budget; with chunked prefill a long prompt is cut to fit what is left. Memory comes from the
:class:`~labkit.kvcache.KVCacheManager`: when a running request's next token finds no free
block, the most recently admitted request is preempted (its blocks freed, to be recomputed
later), so a scheduler can never run what would not fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from labkit.kvcache import KVCacheManager
from labkit.scheduling.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduling flags (``--max-num-seqs``, ``--max-num-batched-tokens``, ...)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class SchedulerOutput:
    """One step's batch.

    ``num_scheduled_tokens`` maps request ids to their new tokens this step. ``rows`` lists
    ``(new_tokens, context_tokens_before)`` for every sequence the model computes, padding
    included: what a step-cost model charges for.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    rows: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.rows.append((num_new_tokens, request.num_computed_tokens))


class Scheduler:
    """Continuous batching over a paged KV cache, with chunked prefill and preemption."""

    def __init__(self, kv_cache: KVCacheManager, config: SchedulerConfig | None = None) -> None:
        self.kv_cache = kv_cache
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse one that could never run on this cache and budget."""
        self.check_request(request)
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` could never run on this cache and budget."""
        longest = request.prompt_len + request.max_tokens - 1  # the last token is never cached
        if -(-longest // self.kv_cache.block_size) > self.kv_cache.num_blocks:
            raise ValueError(f"request {request.request_id!r} needs {longest} tokens of KV, "
                             f"more than the cache's {self.kv_cache.num_blocks} blocks hold")
        if not self.config.enable_chunked_prefill and longest > self.config.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id!r} ({longest} tokens with its output) "
                             f"exceeds max_num_batched_tokens without chunked prefill")

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break
            out.add(request, num_new)
            budget -= num_new
        if not out.preempted:  # after a preemption, memory is short: admit nobody new
            self._admit_waiting(out, budget)
        return out

    def update(self, out: SchedulerOutput, now: float,
               sampled: Mapping[str, int] | None = None) -> list[Request]:
        """Account for a finished step at time ``now``; returns requests that completed.

        ``sampled`` maps request ids to the token an engine sampled for them this step; a
        simulator leaves it out and requests emit their planned tokens.
        """
        sampled = sampled or {}
        done = [r for r in out.requests
                if r.record_step(out.num_scheduled_tokens[r.request_id], now,
                                 sampled.get(r.request_id))]
        for request in done:
            self.kv_cache.free(request.request_id)
            self.running.remove(request)
        self.finished.extend(done)
        return done

    def finish_request(self, request: Request, now: float) -> None:
        """End a request early (a stop token or string, or the client went away), freeing
        its blocks at once. Finishing a finished request does nothing."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self.kv_cache.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            raise ValueError(f"request {request.request_id!r} is not in this scheduler")
        request.finish(now)
        self.finished.append(request)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while self.kv_cache.allocate_slots(request.request_id, request.token_ids, num_new) is None:
            # Victims come from the tail, past ``request``: none is in this step's batch yet.
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            blocks, num_cached = self.kv_cache.get_computed_blocks(request.token_ids)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv_cache.allocate_slots(request.request_id, request.token_ids, num_new,
                                            blocks) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new
