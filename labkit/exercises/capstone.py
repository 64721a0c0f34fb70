"""Checks for the exercises of the capstone lab (``labs/gpu/vllm_deploy_benchmark.ipynb``):
deploy vLLM, check it, load it and hold it to the book's predictions.

The lab draws on chapters 1, 2, 3 and 8, so its checks are those chapters' own, gathered
here under one name, plus the one figure only the capstone asks for: the maximum concurrency
vLLM prints from the KV cache it sized.
"""

from __future__ import annotations

from labkit.checks import positive_int
from labkit.exercises.ch01 import check_decode_tokens_per_s
from labkit.exercises.ch02 import check_kv_bytes_per_token, check_tpot_ms
from labkit.exercises.ch08_deploy import check_failure_threshold
from labkit.grading import Feedback, check_number

__all__ = ["check_decode_tokens_per_s", "check_failure_threshold", "check_kv_bytes_per_token",
           "check_max_concurrency", "check_tpot_ms"]


def check_max_concurrency(answer: object, kv_tokens: int, max_model_len: int) -> Feedback:
    """Exercise 3: how many requests of ``max_model_len`` tokens a KV cache of ``kv_tokens``
    tokens holds at once, each using its whole context: the "Maximum concurrency" vLLM prints
    at start-up (``kv_tokens / max_model_len`` when every layer attends to the whole
    context, as in the course's models)."""
    positive_int("kv_tokens", kv_tokens)
    positive_int("max_model_len", max_model_len)
    expected = kv_tokens / max_model_len
    mistakes = {"rounded down to whole requests (vLLM prints the ratio)":
                    float(kv_tokens // max_model_len),
                "divided the other way round": max_model_len / kv_tokens}
    return check_number(answer, expected, what="maximum concurrency", unit="requests",
                        rel_tol=0.01,
                        mistakes={why: value for why, value in mistakes.items()
                                  if value != expected})
