"""Checks for the exercises of the capstone lab (``labs/gpu/vllm_deploy_benchmark.ipynb``):
deploy vLLM, check it, load it and hold it to the book's predictions.

The lab draws on chapters 1, 2, 3 and 8, so its checks are those chapters' own, gathered
here under one name, plus the one figure only the capstone asks for: the maximum concurrency
vLLM prints from the KV cache it sized.
"""

from __future__ import annotations

from labkit.checks import positive_int
from labkit.hardware import max_concurrency
from labkit.exercises.ch01 import check_decode_tokens_per_s
from labkit.exercises.ch02 import check_kv_bytes_per_token, check_tpot_ms
from labkit.exercises.ch08_deploy import check_failure_threshold
from labkit.grading import Feedback, check_number
from labkit.units import cdiv

__all__ = ["check_decode_tokens_per_s", "check_failure_threshold", "check_kv_bytes_per_token",
           "check_max_concurrency", "check_tpot_ms"]


def check_max_concurrency(answer: object, kv_tokens: int, max_model_len: int,
                          block_size: int) -> Feedback:
    """Exercise 3: how many requests of ``max_model_len`` tokens a KV cache of ``kv_tokens``
    tokens, in blocks of ``block_size``, holds at once, each using its whole context: the
    "Maximum concurrency" vLLM prints at start-up. A request takes whole blocks, so the
    answer is :func:`labkit.hardware.max_concurrency`, vLLM's own rule (chapter 1)."""
    positive_int("kv_tokens", kv_tokens)
    positive_int("block_size", block_size)
    num_blocks = kv_tokens // block_size
    expected = max_concurrency(num_blocks, block_size, max_model_len)
    mistakes = {"divided tokens by tokens: a request takes whole blocks, its last one too":
                    kv_tokens / max_model_len,
                "rounded down to whole requests (vLLM prints the ratio)":
                    float(num_blocks // cdiv(max_model_len, block_size)),
                "divided the other way round": 1 / expected if expected else -1.0}
    return check_number(answer, expected, what="maximum concurrency", unit="requests",
                        rel_tol=0.005,
                        mistakes={why: value for why, value in mistakes.items()
                                  if abs(value - expected) > 0.005 * expected})
