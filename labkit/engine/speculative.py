"""Speculative decoding in the teaching engine (chapter 9):
propose a few tokens cheaply, verify them all in one forward pass, keep the ones the model
would have produced itself.

A decode step reads every weight to produce one token per sequence, so it is memory-bound
(chapter 1's roofline): scoring ``k + 1`` positions of a sequence costs little more than
scoring one. A *proposer* guesses the next ``k`` tokens; the engine appends them to the
sequence, runs the model once over the last known token and the ``k`` drafts, and the
*verifier* walks the drafts in order: where the model's own choice equals the draft, the draft
is accepted and the walk goes on; at the first difference the model's choice replaces it and
the rest are rejected. If every draft is accepted, the model's choice after the last is a
bonus token. A step therefore emits between 1 and ``k + 1`` tokens, and with greedy sampling
exactly the tokens the model would have produced one step at a time.

Here, as in vLLM v1 (``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/spec_decode/``), drafts are
proposed after a step and scheduled in the next one as the request's ``spec_token_ids``; the
KV cache gives them lookahead slots that are never offered to the prefix cache, and the slots
of rejected drafts are handed back after verification
(:meth:`~labkit.kvcache.KVCacheManager.trim_slots`).

Sampled requests are verified by rejection sampling (Leviathan et al. 2023, Chen et al.
2023), which keeps each emitted token's distribution exactly the model's: a draft ``d`` is
accepted with probability ``min(1, p(d) / q(d))``, where ``p`` is the model's distribution
and ``q`` the proposer's; on rejection the token is drawn from ``max(0, p - q)``,
renormalized. An n-gram proposer has no distribution: ``q`` is all on its draft, so ``d`` is
kept with probability ``p(d)`` and a rejection draws from ``p`` without ``d``, as vLLM's
rejection sampler does without draft probabilities (``vllm/v1/sample/rejection_sampler.py``).
A seeded request's tokens therefore differ with and without speculation (the random draws
differ), while their distribution does not.

What the teaching engine implements of vLLM's ``--speculative-config``: ``method="ngram"``
(prompt lookup) with ``num_speculative_tokens``, ``prompt_lookup_min`` and
``prompt_lookup_max``, and ``method="draft_model"`` with ``model``, the draft model's directory
(:mod:`labkit.engine.draft_model`). As in vLLM, a config without a method drafts with its
``model``, or by n-gram when that ``model`` is ``"ngram"``. Requests with a constraint,
logprobs or pending ``min_tokens`` decode one token a step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from labkit.checks import ParameterError, positive_int
from labkit.engine.request import EngineRequest
from labkit.engine.sampling import SamplingParams, sample, token_probabilities

#: The keys of vLLM's ``--speculative-config`` that the teaching engine implements.
SUPPORTED_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min",
                  "prompt_lookup_max")
#: The methods it implements: prompt lookup and a draft model.
METHODS = ("ngram", "draft_model")
#: vLLM's default n-gram lengths when neither is given (``SpeculativeConfig.__post_init__``).
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``, by its key names.

    ``num_speculative_tokens`` drafts are proposed per step. With ``method="ngram"`` the
    proposer looks for the longest suffix of ``prompt_lookup_min`` to ``prompt_lookup_max``
    tokens that occurred earlier in the sequence; with ``method="draft_model"``, ``model``
    (a directory) guesses them.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParameterError("speculative_config", f"speculative_config: method "
                                 f"{self.method!r} is not implemented by the teaching "
                                 f"engine; it implements {', '.join(map(repr, METHODS))}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ParameterError("speculative_config", "speculative_config: model (a draft "
                                 "model's directory) goes with method 'draft_model', and only "
                                 "with it")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError("speculative_config", f"speculative_config: {name} must "
                                     f"be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ParameterError("speculative_config", f"speculative_config: "
                                 f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                                 f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, config: Mapping[str, object] | str) -> SpeculativeConfig:
        """Read vLLM's ``--speculative-config`` (a JSON object or its text). A key the teaching
        engine does not implement is refused by name rather than ignored. As in vLLM, a
        missing method is ``"ngram"`` when ``model`` is ``"ngram"`` and ``"draft_model"``
        otherwise, and a missing n-gram length takes the other's value, both 5 when neither
        is given."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as err:
                raise ParameterError("speculative_config", f"speculative_config: not JSON: "
                                     f"{err}") from None
        if not isinstance(config, Mapping):
            raise ParameterError("speculative_config", "speculative_config: expected a JSON "
                                 "object")
        unknown = sorted(set(config) - set(SUPPORTED_KEYS))
        if unknown:
            raise ParameterError("speculative_config", f"speculative_config: the teaching "
                                 f"engine does not implement {', '.join(unknown)}; it takes "
                                 f"{', '.join(SUPPORTED_KEYS)}")
        if "num_speculative_tokens" not in config:
            raise ParameterError("speculative_config", "speculative_config: "
                                 "num_speculative_tokens is required")
        model = config.get("model")
        method = config.get("method") or ("ngram" if model in ("ngram", "[ngram]")
                                          else "draft_model")
        if method == "ngram":
            model = None  # "ngram" names the method, not a directory
        elif "prompt_lookup_min" in config or "prompt_lookup_max" in config:
            raise ParameterError("speculative_config", f"speculative_config: "
                                 f"prompt_lookup_min and prompt_lookup_max are for method "
                                 f"'ngram', not {method!r}")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low = high if low is None else low
        high = low if high is None else high
        return cls(config["num_speculative_tokens"], method,
                   DEFAULT_PROMPT_LOOKUP if low is None else low,
                   DEFAULT_PROMPT_LOOKUP if high is None else high, model)


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence."""

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most ``max_tokens`` draft tokens to follow ``token_ids`` (none is fine)."""


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: find the longest suffix of ``token_ids`` of ``min_n`` to ``max_n``
    tokens that also occurs earlier, and propose up to ``num_tokens`` tokens that followed it.

    Among matches of the longest length the earliest is taken; the proposal may run into the
    suffix itself and stops at the end of the sequence. This is vLLM's rule
    (``_find_longest_matched_ngram_and_propose_tokens`` in
    ``vllm/v1/spec_decode/ngram_proposer.py``, a KMP scan there; a plain scan here).
    """
    tokens = list(token_ids)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n):  # every earlier occurrence, the earliest first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num_tokens]
    return []


@dataclass(frozen=True)
class NgramProposer:
    """vLLM's ``method="ngram"`` proposer: drafts copied from the sequence itself, free to
    make, and right exactly when the text repeats (code edits, quoting, summaries, loops)."""

    config: SpeculativeConfig

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k <= 0:
            return []
        return propose_ngram(token_ids, k, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)


def verify_greedy(draft_token_ids: Sequence[int], rows: np.ndarray,
                  choose: Callable[[np.ndarray], int]) -> list[int]:
    """The tokens a step emits: the accepted drafts, then the model's own next token.

    ``rows[j]`` are the logits after the last known token and the first ``j`` drafts
    (``len(draft_token_ids) + 1`` rows); ``choose`` picks the model's token from a row, the
    same function that decodes without speculation, so greedy output is unchanged by
    construction: each draft is kept only if it is the token ``choose`` would have picked.
    """
    positive_int("rows", len(rows))
    if len(rows) != len(draft_token_ids) + 1:
        raise ParameterError("rows", f"rows: {len(draft_token_ids)} drafts need "
                             f"{len(draft_token_ids) + 1} rows of logits, got {len(rows)}")
    emitted = []
    for j, row in enumerate(rows):
        token = choose(row)
        emitted.append(token)
        if j == len(draft_token_ids) or token != draft_token_ids[j]:
            break
    return emitted


def verify_sampled(draft_token_ids: Sequence[int], probs: Sequence[np.ndarray],
                   rng: np.random.Generator) -> list[int]:
    """Rejection sampling of drafts proposed without a distribution (n-gram): the tokens a
    step emits. ``probs[j]`` is the model's distribution after the last known token and the
    first ``j`` drafts (one more than there are drafts). Draft ``j`` is kept with probability
    ``probs[j][draft]``; the first one rejected is replaced by a token drawn from
    ``probs[j]`` without it; if all are kept, a bonus token is drawn from the last row. Each
    emitted token is distributed exactly as ``probs`` says, whatever the drafts."""
    if len(probs) != len(draft_token_ids) + 1:
        raise ParameterError("probs", f"probs: {len(draft_token_ids)} drafts need "
                             f"{len(draft_token_ids) + 1} distributions, got {len(probs)}")
    emitted = []
    for draft, p in zip(draft_token_ids, probs, strict=False):
        if rng.random() < p[draft]:  # accepted with probability p(d) / q(d), q(d) = 1
            emitted.append(draft)
            continue
        residual = p.copy()  # max(0, p - q): p without the draft
        residual[draft] = 0.0
        emitted.append(int(rng.choice(len(p), p=residual / residual.sum())))
        return emitted
    emitted.append(int(rng.choice(len(probs[-1]), p=probs[-1])))  # every draft kept: a bonus
    return emitted


def verify(draft_token_ids: Sequence[int], rows: np.ndarray, params: SamplingParams,
           rng: np.random.Generator, allowed: np.ndarray | None = None) -> list[int]:
    """The tokens a step emits for a request that verified ``draft_token_ids``, from the
    model's logits ``rows`` at those positions: greedily for a greedy request (exactly its
    output without speculation), by rejection sampling otherwise (exactly its distribution).
    ``allowed`` masks the vocabulary, as in :func:`~labkit.engine.sampling.sample`."""
    if params.greedy:
        return verify_greedy(draft_token_ids, rows,
                             lambda row: sample(row, params, rng, allowed))
    return verify_sampled(draft_token_ids,
                          [token_probabilities(row, params, allowed) for row in rows], rng)


def speculates(request: EngineRequest) -> bool:
    """Whether drafts can be verified for ``request`` now: a request without a constraint,
    logprobs or pending ``min_tokens``, that is decoding. The others decode one token a step
    (their next token's mask or logprobs depend on the tokens before it)."""
    params = request.params
    return (request.constraint is None and params.logprobs is None
            and request.num_output_tokens >= params.min_tokens
            and request.num_tokens - request.num_computed_tokens == 1)


def propose_drafts(proposer: Proposer, requests: Iterable[EngineRequest]) -> None:
    """Give every request that :func:`speculates` its drafts for the next step: at most what
    it may still emit (``max_tokens``, the context window) less the token the model adds
    after them."""
    for request in requests:
        if speculates(request):
            room = min(request.max_tokens - request.num_output_tokens,
                       request.max_model_len - request.num_tokens) - 1
            request.spec_token_ids = proposer.propose(request.token_ids, room)
