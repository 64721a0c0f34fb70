"""Continuous batching with one token budget, after vLLM v1's scheduler
(:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`:
:numref:`fig-batching-timeline`).

Every step the scheduler hands the model a batch of (request, number of new tokens): running
requests first (one token for a decode, a chunk for an unfinished prefill), then waiting ones,
until ``max_num_batched_tokens`` or ``max_num_seqs`` is reached. Prefill and decode share the
budget; with chunked prefill a long prompt is cut to fit what is left. Memory comes from the
:class:`~labkit.kvcache.KVCacheManager`: when a running request's next token finds no free
block, the most recently admitted request is preempted (its blocks freed, to be recomputed
later), so a scheduler can never run what would not fit.

Each step's output carries every scheduled request's block table, so the engine never asks
the KV cache manager itself. A request's ``check_stop`` decides when it is done; the scheduler
then frees its blocks.

Speculative decoding (:mod:`labkit.engine.speculative`): a decoding request that carries draft
tokens (``spec_token_ids``) is scheduled with them, in lookahead slots, when the budget and the
free blocks allow; otherwise it decodes one token as usual (speculation never preempts
anyone). After the step, the slots of rejected drafts go back to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from labkit.checks import ParameterError, positive_int
from labkit.hardware.kv_budget import check_sequence_fits
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
            positive_int(name, getattr(self, name))


@dataclass
class SchedulerOutput:
    """One step's batch.

    ``num_scheduled_tokens`` maps request ids to their new tokens this step, ``block_ids`` to
    their block tables (physical block ids) after this step's allocation. ``rows`` lists
    ``(new_tokens, context_tokens_before)`` for every sequence the model computes, padding
    included: what a step-cost model charges for. ``spec_token_ids`` maps the requests
    scheduled with draft tokens to them; their ``num_scheduled_tokens`` count the drafts.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    rows: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def add(self, request: Request, num_new_tokens: int, block_ids: list[int]) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.block_ids[request.request_id] = block_ids
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
        """Queue a request; refuse one that could never run on this cache and budget.

        The request gets the KV cache's block hasher and hashes its prompt's blocks, once.
        """
        self.check_request(request)
        request.set_block_hasher(self.kv_cache.block_hasher)
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise :class:`~labkit.hardware.DoesNotFitError` or
        :class:`~labkit.checks.ParameterError` (``max_tokens``) if ``request`` could never run
        on this cache and budget."""
        longest = request.prompt_len + request.max_tokens - 1  # the last token is never cached
        check_sequence_fits(longest, self.kv_cache.num_blocks, self.kv_cache.block_size,
                            f"request {request.request_id!r} ({longest} tokens of KV)",
                            param="max_tokens")
        if not self.config.enable_chunked_prefill and longest > self.config.max_num_batched_tokens:
            raise ParameterError("max_tokens", f"request {request.request_id!r} ({longest} "
                                               f"tokens with its output) exceeds "
                                               f"max_num_batched_tokens without chunked prefill")

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(self.running, self.config.max_num_batched_tokens, out)
        if not out.preempted:  # after a preemption, memory is short: admit nobody new
            self.admit_waiting(out, budget)
        return out

    def schedule_running(self, requests: list[Request], budget: int,
                         out: SchedulerOutput) -> int:
        """Schedule ``requests`` (``running``, or its tail) in order within ``budget`` tokens;
        returns the budget left.

        ``schedule()`` passes all of ``running``. The fast simulator
        (:mod:`labkit.simulate.fast`) schedules the decodes at its head itself, in bulk, and
        passes the rest with what is left of the budget.
        """
        for request in list(requests):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts_to_verify(request, num_new, budget)
            if not drafts and not self._allocate_or_preempt(request, num_new, out):
                break
            out.add(request, num_new + len(drafts),
                    self.kv_cache.get_block_ids(request.request_id))
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
            budget -= num_new + len(drafts)
        return budget

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The draft tokens ``request`` verifies this step, their slots allocated after its
        ``num_new`` tokens: as many of its ``spec_token_ids`` as the budget leaves room for,
        if it is decoding and the blocks for them are free; none otherwise. Its drafts are
        used up either way: the next proposal starts from the tokens this step emits."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return []
        drafts = drafts[:budget - num_new]
        if drafts and self.kv_cache.allocate_slots(
                request.request_id, request.token_ids, num_new,
                num_lookahead_tokens=len(drafts)) is not None:
            return drafts
        return []

    def update(self, out: SchedulerOutput, now: float,
               sampled: Mapping[str, int | list[int]] | None = None) -> list[Request]:
        """Account for a finished step at time ``now``; returns requests that completed.

        ``sampled`` maps request ids to the token an engine sampled for them this step (for a
        request scheduled with drafts, the list of tokens the verifier emitted); a simulator
        leaves it out and requests emit their planned tokens. Every request whose
        ``check_stop`` ends it (through ``record_step``) leaves ``running`` and frees its
        blocks; one that verified drafts and goes on keeps the slots of its accepted ones only.
        """
        sampled = sampled or {}
        done = []
        for request in out.requests:
            request_id = request.request_id
            num_computed = out.num_scheduled_tokens[request_id]
            drafts = out.spec_token_ids.get(request_id)
            if drafts:  # the emitted tokens: the accepted drafts, then the model's own
                num_computed -= len(drafts) - (len(sampled[request_id]) - 1)  # rejected
            if request.record_step(num_computed, now, sampled.get(request_id)):
                done.append(request)
            elif drafts:
                self.kv_cache.trim_slots(request_id, request.token_ids,
                                         request.num_computed_tokens)
        for request in done:
            self.kv_cache.free(request.request_id)
            self.running.remove(request)
        self.finished.extend(done)
        return done

    def finish_request(self, request: Request, now: float) -> None:
        """End a request early (the client went away), freeing its blocks at once.

        Its ``finish_reason`` becomes ``"abort"`` unless one is set already. Finishing a
        finished request does nothing.
        """
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self.kv_cache.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            raise ParameterError("request", f"request {request.request_id!r} is not in this "
                                            f"scheduler")
        if request.finish_reason is None:
            request.finish_reason = "abort"
        request.finish(now)
        self.finished.append(request)

    def fork_request(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """Start ``child`` on ``parent``'s KV cache (parallel sampling, ``n > 1``).

        Call it between steps, typically right after the step that computed the parent's
        last prompt token. ``child`` is a new request whose tokens begin with the parent's
        computed ones and go at least one further. For parallel sampling the caller builds it
        from the parent's prompt, samples its first token from the same logits as the
        parent's and adds it with ``child.append_output_token`` (and forks only if that did
        not already finish it).

        The parent's full blocks are shared (reference counts) and its partly filled last
        block is copied, since both sequences will write to it. The child joins ``running``
        with the parent's ``num_computed_tokens``; the result lists the ``(src_block_id,
        dst_block_id)`` copies the engine must make in its KV tensors before the next step.
        When the child cannot join (no block free for the copy, ``max_num_seqs`` running, or
        a parent that holds no KV any more), it waits, first in line, and will recompute,
        taking the prompt's full blocks from the prefix cache: the result is then ``[]``.
        """
        self.check_request(child)
        shared = parent.num_computed_tokens
        can_share = parent in self.running
        if can_share and self.kv_cache.req_num_slots[parent.request_id] != shared:
            raise ParameterError("parent", f"parent: request {parent.request_id!r} is in the "
                                           f"middle of a step; fork between steps")
        if can_share and (child.num_tokens <= shared
                          or child.token_ids[:shared] != parent.token_ids[:shared]):
            raise ParameterError("child", f"child {child.request_id!r} must begin with the "
                                          f"{shared} computed tokens of {parent.request_id!r} "
                                          f"and have at least one more")
        child.set_block_hasher(self.kv_cache.block_hasher)
        if can_share and len(self.running) < self.config.max_num_seqs:
            copies = self.kv_cache.fork(parent.request_id, child.request_id, child.block_hashes)
            if copies is not None:
                child.status = RequestStatus.RUNNING
                child.num_computed_tokens = shared
                self.running.append(child)
                return copies
        self.waiting.appendleft(child)  # part of a request already running: it goes first
        return []

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while self.kv_cache.allocate_slots(request.request_id, request.token_ids, num_new) is None:
            # Victims come from the tail, past ``request``: none is in this step's batch yet.
            if self.preempt_last(out) is request:
                return False
        return True

    def preempt_last(self, out: SchedulerOutput) -> Request:
        """Preempt the most recently admitted running request, vLLM's victim; returns it."""
        victim = self.running.pop()
        self._preempt(victim, out)
        return victim

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(request.request_id)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit requests from the head of ``waiting`` (preempted ones went back there) while
        ``budget``, seats (``max_num_seqs``) and free blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            blocks, num_cached = ([], 0) if request.skip_prefix_cache else \
                self.kv_cache.get_computed_blocks(request.block_hashes, request.num_tokens)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv_cache.allocate_slots(request.request_id, request.token_ids, num_new,
                                            blocks, request.block_hashes) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self.running.append(request)
            out.add(request, num_new, self.kv_cache.get_block_ids(request.request_id))
            budget -= num_new
