"""Sampling parameters and the sampler, with vLLM's names and checks (:ref:`ch02-offline-api`).

``SamplingParams`` rejects what vLLM rejects, with a :class:`~labkit.checks.ParameterError`
that names the field, so the server can answer 400 with ``param`` set. ``sample`` turns one
row of logits into a token id; ``logprobs_of`` reports what vLLM reports by default
(``logprobs_mode="raw_logprobs"``): the log-softmax of the model's raw logits, before
temperature, top-k or top-p, for the sampled token and the most likely ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.outputs import Logprob
from labkit.engine.structured import StructuredOutputsParams

# Below this temperature sampling is greedy, as in vLLM (``_SAMPLING_EPS``): dividing logits
# by 1e-320 overflows to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default ``--max-logprobs``
# Every stop string is looked for after every token, in the engine loop all requests share:
# 200,000 of them (a 3 MB request) stall every other request for seconds per token. vLLM sets
# no limit; OpenAI allows 4.
MAX_STOP_STRINGS = 256
_SEED_RANGE = (-2**63, 2**63 - 1)  # vLLM's request models accept any 64-bit seed


class RequestOutputKind(Enum):
    """When the engine reports a request, as vLLM's enum of that name: after every step
    (``CUMULATIVE``, what a stream reads), or once it has finished (``FINAL_ONLY``, what the
    offline ``LLM.generate`` asks for, so no snapshot is built per token)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2  # vLLM's value; its DELTA (1) is not implemented here


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. Field names follow vLLM's.

    ``temperature`` below 1e-5 (0 included) is greedy. ``top_k=-1`` (or 0) and ``top_p=1``
    disable those filters; a ``top_k`` above the vocabulary keeps every token. ``seed`` makes
    one request's sampling reproducible whatever it is batched with. ``n`` choices share the
    prompt's KV blocks (the fork of :ref:`ch03-paged-attention`); with a seed, choice ``i`` uses
    ``seed + i``, as vLLM does. ``logprobs`` asks for the sampled token's log-probability and the
    ``logprobs`` most likely ones; ``prompt_logprobs`` the same for every prompt token. ``regex`` or
    ``structured_outputs`` constrain the output (:ref:`ch02-sglang`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the end of the context window, as in vLLM
    min_tokens: int = 0
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    regex: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        positive_int("n", self.n)
        in_range("temperature", self.temperature, 0)
        if self.n > 1 and self.greedy:  # vLLM's rule: n identical answers are wasted work
            raise ParameterError("n", f"n must be 1 when using greedy sampling, got {self.n}")
        in_range("top_p", self.top_p, 0, 1, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ParameterError("top_k", f"top_k must be -1 or 0 (disabled) or a positive "
                                          f"integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)
                                      or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise ParameterError("seed", f"seed must be an integer in [-2**63, 2**63 - 1], "
                                         f"got {self.seed!r}")
        if self.max_tokens is not None:
            positive_int("max_tokens", self.max_tokens)
        positive_int("min_tokens", self.min_tokens, at_least=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError("min_tokens", f"min_tokens must be at most max_tokens "
                                               f"({self.max_tokens}), got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ParameterError("stop", "stop must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParameterError("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, "
                                         f"got {len(self.stop)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value, at_least=0)
                if value > MAX_LOGPROBS:
                    raise ParameterError(name, f"{name} must be at most {MAX_LOGPROBS} "
                                               f"(vLLM's --max-logprobs), got {value}")
        if self.regex is not None and self.structured_outputs is not None:
            raise ParameterError("structured_outputs", "give regex or structured_outputs, "
                                                       "not both")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one choice each, seeds ``seed + i``
        (modulo 2**64, kept in the signed range, as a generator reads a 64-bit seed)."""
        if self.seed is None:
            return replace(self, n=1)
        low, high = _SEED_RANGE
        return replace(self, n=1, seed=(self.seed + index - low) % (high - low + 1) + low)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           allowed: np.ndarray | None = None) -> int:
    """One token id from a row of logits: mask, temperature, then top-k, then top-p.

    ``allowed`` (a boolean mask from a constraint) must let at least one token through; the
    engine checks that before calling.
    """
    if params.greedy:
        if allowed is not None:
            logits = np.where(allowed, logits, -np.inf)
        return int(np.argmax(logits))
    probs = token_probabilities(logits, params, allowed)
    return int(rng.choice(len(probs), p=probs))


def token_probabilities(logits: np.ndarray, params: SamplingParams,
                        allowed: np.ndarray | None = None) -> np.ndarray:
    """The distribution :func:`sample` draws from for a sampled (not greedy) request: mask,
    temperature, then top-k, then top-p, as float64 probabilities that sum to 1. Speculative
    decoding's rejection sampler needs it whole (:func:`labkit.engine.speculative.verify`)."""
    if allowed is not None:
        logits = np.where(allowed, logits, -np.inf)
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(scaled):
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(probs, dtype=bool)
        mask[keep] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def logprobs_of(logits: np.ndarray, token_id: int, num_top: int,
                decode) -> dict[int, Logprob]:
    """vLLM's logprobs entry for one position: ``token_id`` first, then the ``num_top`` most
    likely tokens (the sampled one is listed once). ``rank`` is 1 for the most likely token;
    ``decode(id)`` gives each token's text.
    """
    row = logits.astype(np.float64)
    shifted = row - row.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    rank = int((logp > logp[token_id]).sum()) + 1
    entries = {token_id: Logprob(float(logp[token_id]), rank, decode(token_id))}
    for rank, tid in enumerate(np.argsort(-logp, kind="stable")[:num_top], start=1):
        entries.setdefault(int(tid), Logprob(float(logp[tid]), rank, decode(int(tid))))
    return entries


def rng_for(seed: int | None, fallback: np.random.SeedSequence) -> np.random.Generator:
    """A request's own generator: from its seed (any 64-bit integer), else from the engine's."""
    if seed is None:
        return np.random.default_rng(fallback)
    return np.random.default_rng(seed % 2**64)
