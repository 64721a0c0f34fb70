"""Checks for the exercises of the chapter 9 lab on speculative decoding
(``labs/09_speculative_decoding.ipynb``).

Every expected value comes from the module the chapter teaches: the tokens a step emits from
:func:`labkit.simulate.speculation.expected_tokens_per_step`, the emitted distribution from
the rule of :func:`labkit.engine.speculative.verify_sampled`, the ratios from the counters as
vLLM defines them (``vllm/v1/spec_decode/metrics.py``). The mistakes they name are the usual
ones: the bonus token forgotten, drafts after a rejection counted as if they could still be
kept, the rejected draft's probability left in the distribution a rejection draws from, the
verification step taken to cost what a plain step does, and vLLM's two ratios confused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit.checks import ParameterError, in_range, positive_int
from labkit.grading import Feedback, check_number
from labkit.simulate.speculation import expected_tokens_per_step


def check_tokens_per_step(answer: object, acceptance_rate: float = 0.7,
                          num_speculative_tokens: int = 4) -> Feedback:
    """Lab 09, exercise 1: the mean tokens one verification step emits per request, when each
    of ``num_speculative_tokens`` drafts is accepted with probability ``acceptance_rate``
    until the first rejection."""
    a, k = acceptance_rate, num_speculative_tokens
    expected = expected_tokens_per_step(a, k)
    mistakes = {
        "counted the accepted drafts but not the model's own token after them (every step "
        "emits one more)": expected - 1,
        "counted every draft as if it were kept independently: after the first rejection "
        "the later drafts are thrown away": 1 + k * a,
        "used a geometric series without end, as if there were no limit of k drafts":
            1 / (1 - a) if a < 1 else math.inf,
        "took the chance that all k drafts are kept, times k + 1": a ** k * (k + 1),
    }
    return check_number(answer, expected, what="tokens per verification step",
                        unit="tokens", rel_tol=0.005, mistakes=mistakes)


def check_emitted_probability(answer: object, probs: Sequence[float] = (0.5, 0.3, 0.2),
                              draft: int = 1, token: int = 0) -> Feedback:
    """Lab 09, exercise 2: the probability that a position emits ``token`` when the model's
    distribution there is ``probs`` and an n-gram proposer drafted ``draft``: the draft is kept
    with probability ``p(draft)``; a rejection draws from ``p`` without the draft,
    renormalized."""
    total = math.fsum(probs)
    if not probs or any(p < 0 for p in probs) or not math.isclose(total, 1.0, rel_tol=1e-9):
        raise ParameterError("probs", f"probs must be a probability distribution, got {probs}")
    for name, index in (("draft", draft), ("token", token)):
        in_range(name, index, 0, len(probs) - 1)
    if token == draft:
        raise ParameterError("token", "token must differ from draft: the exercise asks about a "
                                      "token the proposer did not draft")
    if probs[draft] == 1:
        raise ParameterError("probs", "probs must leave the draft a chance of rejection")
    rejected = 1 - probs[draft]
    # Only a rejection can emit ``token``: P(reject) x p(token) / (1 - p(draft)) = p(token).
    expected = rejected * probs[token] / rejected
    mistakes = {
        "drew the replacement from p without removing the draft and renormalizing":
            rejected * probs[token],
        "removed the draft but forgot to weight by the chance the draft is rejected":
            probs[token] / rejected,
        "gave the draft's probability to the token as well": probs[token] + probs[draft],
    }
    return check_number(answer, expected, what="probability of emitting that token",
                        rel_tol=0.005, mistakes=mistakes)


def check_speedup(answer: object, tokens_per_step: float = 2.8, plain_step_ms: float = 20.0,
                  verify_step_ms: float = 24.0) -> Feedback:
    """Lab 09, exercise 4: the decode speed-up from speculation, when a verification step
    emits ``tokens_per_step`` tokens per request and takes ``verify_step_ms`` where a plain
    step takes ``plain_step_ms``."""
    in_range("tokens_per_step", tokens_per_step, 1)
    in_range("plain_step_ms", plain_step_ms, 0, low_open=True)
    in_range("verify_step_ms", verify_step_ms, 0, low_open=True)
    expected = tokens_per_step * plain_step_ms / verify_step_ms
    mistakes = {
        "took the tokens per step for the speed-up, as if verifying drafts cost nothing":
            tokens_per_step,
        "divided the step times the wrong way round": tokens_per_step * verify_step_ms
                                                      / plain_step_ms,
        "left out the model's own token per step": (tokens_per_step - 1) * plain_step_ms
                                                   / verify_step_ms,
    }
    return check_number(answer, expected, what="speed-up", unit="x", rel_tol=0.005,
                        mistakes=mistakes)


def check_acceptance_rate(answer: object, num_drafts: float, num_draft_tokens: float,
                          num_accepted_tokens: float) -> Feedback:
    """Lab 09, exercise 3: vLLM's draft acceptance rate from its three counters, as measured
    on the lab's server."""
    for name, value in (("num_drafts", num_drafts), ("num_draft_tokens", num_draft_tokens),
                        ("num_accepted_tokens", num_accepted_tokens)):
        in_range(name, value, 0)
    positive_int("num_draft_tokens", round(num_draft_tokens))
    expected = num_accepted_tokens / num_draft_tokens
    mistakes = {}
    if num_drafts:
        mistakes["divided by the verification steps (num_drafts): accepted tokens per step is "
                 "the mean acceptance length minus one, not a rate"] = (num_accepted_tokens
                                                                       / num_drafts)
        mistakes["computed the mean acceptance length, 1 + accepted / drafts"] = (
            1 + num_accepted_tokens / num_drafts)
    mistakes["computed the rejected share"] = 1 - expected
    return check_number(answer, expected, what="draft acceptance rate", rel_tol=0.005,
                        mistakes=mistakes)
