"""A request as the scheduler sees it
(:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`:
:numref:`fig-batching-timeline`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from labkit.checks import ParameterError
from labkit.kvcache.hashing import BlockHash, BlockHasher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt, the tokens it will produce, and what happened to it, in seconds.

    A simulator knows the output in advance and passes it as ``output_plan``; an engine
    samples each token and passes ``max_tokens`` instead. ``num_computed_tokens`` counts tokens
    whose K and V are in the cache; preemption by recompute sets it back to zero.

    ``spec_token_ids`` are draft tokens a speculative proposer guessed to follow
    ``token_ids``, for the next step to verify (vLLM's name); they are not the request's
    tokens until the model accepts them.

    ``block_hashes`` names the request's full blocks for prefix caching, like vLLM's
    ``request.block_hashes``. ``block_hasher`` (the KV cache's; the scheduler sets it) hashes
    each block once: the prompt's when the hasher is set, every later one when a token fills
    it. :meth:`check_stop` is the one place that decides the request is done; an engine's
    subclass extends it.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_plan: Sequence[int] | None = None
    arrival_time: float = 0.0
    max_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    token_ids: list[int] = field(init=False)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    block_hasher: BlockHasher | None = field(default=None, repr=False)
    block_hashes: list[BlockHash] = field(init=False, repr=False)
    spec_token_ids: list[int] = field(default_factory=list, init=False, repr=False)
    finish_reason: str | None = field(default=None, init=False)  # "length", "stop", "abort"
    stop_reason: int | str | None = field(default=None, init=False)  # the stop token or string

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ParameterError("prompt_token_ids", f"prompt_token_ids of request "
                                                     f"{self.request_id!r} must have a token")
        if self.output_plan is not None:
            if self.max_tokens not in (None, len(self.output_plan)):
                raise ParameterError("max_tokens", f"max_tokens of request {self.request_id!r} "
                                                   f"must equal the length of output_plan")
            self.max_tokens = len(self.output_plan)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ParameterError("max_tokens", f"max_tokens of request {self.request_id!r} must "
                                               f"be an integer >= 1, got {self.max_tokens!r}")
        if self.arrival_time < 0:
            raise ParameterError("arrival_time", f"arrival_time of request {self.request_id!r} "
                                                 f"must be >= 0, got {self.arrival_time}")
        # Copies: the caller's list may change later (a child built from its parent's tokens).
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.block_hashes = []
        self._hash_new_blocks()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and every token produced."""
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def skip_prefix_cache(self) -> bool:
        """Compute the whole prompt even when it is cached. An engine's subclass says so
        when it must return the prompt's logprobs, which need logits at every position."""
        return False

    def set_block_hasher(self, block_hasher: BlockHasher | None) -> None:
        """Name this request's blocks with ``block_hasher`` (``None``: no prefix caching).

        Nothing happens when it is the hasher the request has already; otherwise the blocks
        known so far are hashed anew, once.
        """
        if block_hasher == self.block_hasher:
            return
        self.block_hasher, self.block_hashes = block_hasher, []
        self._hash_new_blocks()

    def record_step(self, num_new_tokens: int, now: float,
                    token_id: int | Sequence[int] | None = None) -> bool:
        """Account for ``num_new_tokens`` computed in a step ending at ``now``.

        Once every known token is computed the model emits the next one: ``token_id`` when an
        engine sampled it, else the next planned token. A step that verified draft tokens
        emits several: ``token_id`` is then the list of them (the accepted drafts, whose
        slots ``num_new_tokens`` counts, and the token after them), appended in order until
        one ends the request. Returns True when :meth:`check_stop` says a token ends the
        request, which is then finished.
        """
        self.num_computed_tokens += num_new_tokens
        if self.num_computed_tokens < self.num_tokens:
            return False  # a prefill chunk: no token sampled yet
        if token_id is None:
            if self.output_plan is None:
                raise ParameterError("token_id", f"token_id: request {self.request_id!r} has no "
                                                 f"planned output: pass the sampled token_id")
            token_id = self.output_plan[self.num_output_tokens]
        if isinstance(token_id, int):
            return self.append_output_token(token_id, now)
        for token in token_id:
            if self.append_output_token(token, now):
                return True  # the tokens after it are dropped, as vLLM drops them
        return False

    def append_output_token(self, token_id: int, now: float) -> bool:
        """Add one produced token at time ``now``; returns True if it ends the request.

        A token that fills a block gets that block hashed now. Every produced token passes
        :meth:`check_stop`; a request it stops is marked finished at ``now``. Engines call this
        directly only for a forked child's first token (see ``Scheduler.fork_request``).
        """
        self.token_ids.append(token_id)
        self.token_times.append(now)
        self._hash_new_blocks()
        if not self.check_stop():
            return False
        self.finish(now)
        return True

    def check_stop(self) -> bool:
        """Whether the request is done after its latest token; sets ``finish_reason`` if so.

        The base rule is the length limit, vLLM's ``"length"``: ``max_tokens`` produced. An
        engine's subclass adds end of sequence, stop token ids and stop strings (``"stop"``,
        with ``stop_reason``) and calls ``super().check_stop()`` for the length limit.
        """
        if self.num_output_tokens < self.max_tokens:
            return False
        self.finish_reason = "length"
        return True

    def finish(self, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_time = now

    def _hash_new_blocks(self) -> None:
        if self.block_hasher is not None:
            self.block_hasher.extend(self.block_hashes, self.token_ids)
