"""What speculative decoding buys at scale (chapter 9): the tokens a verification step emits,
from the acceptance rate, over the time it takes, from chapter 1's roofline.

A decode step at small batch is bound by memory bandwidth: it reads every weight to produce
one token per sequence. Verifying ``k`` drafts makes each sequence ``k + 1`` tokens of that
step, which costs almost nothing while the step stays memory-bound, so each step emits more
tokens for about the same time. With short contexts, as the batch grows, the step turns
compute-bound (chapter 1's ``decode_compute_bound_batch``), its time grows with its tokens,
and ``k + 1`` tokens per sequence cost ``k + 1`` times as much: past that point speculation
slows the server down, which is what vLLM users see when n-gram speculation is left on under
heavy load of short requests. With long contexts every sequence's KV cache is read each step
whatever the batch, the step stays memory-bound, and speculation keeps paying at large
batches (MagicDec: Chen et al. 2024, arXiv:2408.11049).

The model here is the papers' (Leviathan et al. 2023; Chen et al. 2023): each
draft is accepted independently with probability ``acceptance_rate`` until the first
rejection, and every step proposes ``num_speculative_tokens`` drafts. The same model drives
the simulator (:class:`SimulatedSpeculation`), where the batch, the queue and the KV cache are
those of a served workload rather than one fixed step. Real proposers draft
fewer where they find no match (n-gram) and accept runs, not coin flips; the teaching engine
and vLLM measure the real figures (``vllm:spec_decode_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from labkit.checks import in_range, positive_int
from labkit.hardware import GPU, ModelSpec, StepBound, step_bound
from labkit.scheduling import Request, SchedulerOutput


def expected_tokens_per_step(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Mean tokens one verification step emits per sequence: the accepted drafts and the
    model's own token after them, ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)`` for
    acceptance rate ``a`` and ``k`` drafts (Leviathan et al. 2023, equation 1); ``k + 1`` when
    every draft is accepted."""
    in_range("acceptance_rate", acceptance_rate, 0, 1)
    positive_int("num_speculative_tokens", num_speculative_tokens)
    return sum(acceptance_rate ** i for i in range(num_speculative_tokens + 1))


@dataclass(frozen=True)
class SpeculationGain:
    """One decode step with and without speculation, for a whole batch (chapter 9).

    ``plain`` is a decode step (one token per sequence), ``verify`` the step that checks
    ``num_speculative_tokens`` drafts per sequence, ``draft_s`` the proposer's time per step
    (0 for n-gram lookup), all in seconds per GPU, as :class:`~labkit.hardware.StepBound`.
    """

    batch_size: int
    acceptance_rate: float
    num_speculative_tokens: int
    plain: StepBound
    verify: StepBound
    draft_s: float

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens each sequence gets per verification step."""
        return expected_tokens_per_step(self.acceptance_rate, self.num_speculative_tokens)

    @property
    def step_time_ratio(self) -> float:
        """A speculative step's time (drafting and verification) over a plain step's."""
        return (self.verify.time_s + self.draft_s) / self.plain.time_s

    @property
    def speedup(self) -> float:
        """Output tokens per second with speculation over without: above 1 it pays."""
        return self.tokens_per_step / self.step_time_ratio

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the whole batch with speculation (a bound, as the
        roofline's)."""
        return self.batch_size * self.tokens_per_step / (self.verify.time_s + self.draft_s)


def speculative_decode_gain(model: ModelSpec | str, gpu: GPU | str, batch_size: int,
                            context_len: int, num_speculative_tokens: int,
                            acceptance_rate: float, draft_cost: float = 0.0,
                            weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                            tensor_parallel_size: int = 1) -> SpeculationGain:
    """Chapter 1's roofline for ``batch_size`` sequences of ``context_len`` tokens, decoding
    one token a step or verifying ``num_speculative_tokens`` drafts each (rows of ``k + 1``
    new tokens), with drafts accepted at ``acceptance_rate``.

    ``draft_cost`` is the proposer's time per step as a fraction of a plain decode step: 0
    for n-gram lookup; a draft model ``r`` times as fast as the target, run ``k`` times a
    step, costs about ``k / r``.
    """
    positive_int("batch_size", batch_size)
    positive_int("context_len", context_len)
    expected_tokens_per_step(acceptance_rate, num_speculative_tokens)  # checks both
    in_range("draft_cost", draft_cost, 0)
    context = context_len - 1  # the tokens before the one being decoded
    plain = step_bound(model, gpu, [(1, context)] * batch_size, weight_dtype, kv_dtype,
                       tensor_parallel_size)
    verify = step_bound(model, gpu, [(num_speculative_tokens + 1, context)] * batch_size,
                        weight_dtype, kv_dtype, tensor_parallel_size)
    return SpeculationGain(batch_size, acceptance_rate, num_speculative_tokens, plain, verify,
                           draft_cost * plain.time_s)


@dataclass(frozen=True)
class SimulatedSpeculation:
    """Speculative decoding in the simulator (chapter 9): before every step each decoding
    request proposes up to ``num_speculative_tokens`` drafts; verification accepts each with
    probability ``acceptance_rate`` until the first rejection (the papers' model, seeded by
    ``seed``); a proposer that is not free costs ``draft_cost`` plain decode steps of the
    drafting requests per step (0 for n-gram lookup, about ``k / r`` for a draft model ``r``
    times faster than the target). The verification step itself is charged by the cost
    model on its real rows, ``k + 1`` tokens per drafting request, so a batch that turns
    compute-bound pays for its drafts as it would on the GPU."""

    num_speculative_tokens: int
    acceptance_rate: float
    draft_cost: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        expected_tokens_per_step(self.acceptance_rate, self.num_speculative_tokens)  # checks
        in_range("draft_cost", self.draft_cost, 0)


class PlannedSpeculator:
    """Drafts for requests whose output is planned, and the tokens their verification emits:
    the drafts are the planned tokens, and a draw decides how many of them the model keeps
    (:func:`labkit.simulate.simulate` with ``speculation``)."""

    def __init__(self, speculation: SimulatedSpeculation) -> None:
        self.speculation = speculation
        self.rng = np.random.default_rng(speculation.seed)

    def propose(self, requests: Iterable[Request]) -> None:
        """Give every decoding request its drafts: its next planned tokens, as many as
        ``num_speculative_tokens`` and as it may still emit less the token after them."""
        for request in requests:
            if (request.output_plan is None
                    or request.num_tokens - request.num_computed_tokens != 1):
                continue
            start = request.num_output_tokens
            room = len(request.output_plan) - start - 1
            k = min(self.speculation.num_speculative_tokens, room)
            request.spec_token_ids = list(request.output_plan[start:start + k]) if k > 0 else []

    def verify(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """The tokens each request that verified drafts in ``out`` emits: the accepted drafts
        and the planned token after them. Call it before the scheduler's ``update``."""
        emitted = {}
        for request in out.requests:
            drafts = out.spec_token_ids.get(request.request_id)
            if not drafts:
                continue
            accepted = 0
            while (accepted < len(drafts)
                   and self.rng.random() < self.speculation.acceptance_rate):
                accepted += 1
            start = request.num_output_tokens
            emitted[request.request_id] = list(request.output_plan[start:start + accepted + 1])
        return emitted

    def draft_time(self, out: SchedulerOutput, step_cost: Callable[[list], float]) -> float:
        """Seconds the proposer adds to the step ``out``: ``draft_cost`` plain decode steps
        of the requests that draft."""
        if not self.speculation.draft_cost or not out.spec_token_ids:
            return 0.0
        rows = [(1, request.num_computed_tokens) for request in out.requests
                if out.spec_token_ids.get(request.request_id)]
        return self.speculation.draft_cost * step_cost(rows) if rows else 0.0
