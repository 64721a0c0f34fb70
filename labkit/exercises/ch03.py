"""Checks for the exercises of the chapter 3 labs (paged KV cache, batching, parallelism)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from labkit.grading import Feedback, check_number
from labkit.hardware import get_model
from labkit.kvcache import memory_waste
from labkit.parallel import allreduce_bytes_per_layer, link_gb_s_per_direction, ring_all_reduce_s
from labkit.scheduling import static_decode_steps
from labkit.units import cdiv


def check_blocks_needed(answer: object, num_tokens: int = 50, block_size: int = 16) -> Feedback:
    """Lab 03a, exercise 1: blocks a sequence of ``num_tokens`` occupies."""
    expected = cdiv(num_tokens, block_size)
    return check_number(answer, expected, what=f"blocks for {num_tokens} tokens", rel_tol=0,
                        mistakes={"rounded down instead of up": num_tokens // block_size})


def check_cached_prefix_tokens(answer: object, prompt_len: int = 100,
                               block_size: int = 16) -> Feedback:
    """Lab 03a, exercise 2: prompt tokens a fully cached prompt serves from the cache."""
    expected = (prompt_len - 1) // block_size * block_size
    mistakes = {"forgot that the last prompt token is always recomputed":
                    prompt_len // block_size * block_size,
                "counted blocks, not tokens": (prompt_len - 1) // block_size,
                "assumed the whole prompt is served, partial block included": prompt_len}
    return check_number(answer, expected, what="cached prompt tokens", unit="tokens",
                        rel_tol=0, mistakes=mistakes)


def check_paged_waste(answer: object, seq_lens: Sequence[int], block_size: int = 16,
                      max_model_len: int = 4096) -> Feedback:
    """Lab 03a, exercise 3: the fraction of paged KV slots left empty."""
    waste = memory_waste(seq_lens, block_size, max_model_len)
    return check_number(answer, waste.paged_waste, what="paged waste", rel_tol=0.01,
                        mistakes={"computed the contiguous waste": waste.contiguous_waste,
                                  "gave a percentage, not a fraction": 100 * waste.paged_waste})


def check_static_steps(answer: object, output_lens: Sequence[int],
                       batch_size: int = 4) -> Feedback:
    """Lab 03b, exercise 1: decode steps of static batching, the tutorial's way."""
    expected = static_decode_steps(output_lens, batch_size)
    return check_number(answer, expected, what="static decode steps", rel_tol=0, mistakes={
        "summed every output instead of the longest per batch": sum(output_lens),
        "took the longest output of all requests once": max(output_lens)})


def check_steps_to_first_token(answer: object, prompt_len: int = 1200,
                               max_num_batched_tokens: int = 512) -> Feedback:
    """Lab 03b, exercise 2: steps until the first token with chunked prefill, alone."""
    expected = cdiv(prompt_len, max_num_batched_tokens)
    return check_number(answer, expected, what="steps to the first token", rel_tol=0,
                        mistakes={"rounded down": prompt_len // max_num_batched_tokens,
                                  "added a separate decode step": expected + 1})


def check_row_parallel(fn: Callable | None, tp: int = 4, seed: int = 0) -> Feedback:
    """Lab 03c, exercise 1: ``fn(x_parts, w_parts, b)`` must return ``x @ w + b``."""
    if fn is None:
        return Feedback(False, "Not answered yet: write the row-parallel linear layer.")
    rng = np.random.default_rng(seed)
    x, w, b = rng.normal(size=(3, 8 * tp)), rng.normal(size=(8 * tp, 5)), rng.normal(size=5)
    got = np.asarray(fn(np.split(x, tp, axis=1), np.split(w, tp, axis=0), b))
    expected = x @ w + b
    if got.shape != expected.shape:
        return Feedback(False, f"Not quite: the output shape is {got.shape}, "
                               f"expected {expected.shape}.")
    if np.allclose(got, expected):
        return Feedback(True, "Correct: partial products summed, bias added once.")
    if np.allclose(got, expected + (tp - 1) * b):
        return Feedback(False, f"Not quite: the bias was added on every rank ({tp} times).")
    if np.allclose(got, x @ w):
        return Feedback(False, "Not quite: the bias is missing.")
    return Feedback(False, "Not quite: the result differs from x @ w + b.")


def check_ring_all_reduce_us(answer: object, num_bytes: float = 16e6, tp: int = 8,
                             gpu: str = "H100 SXM") -> Feedback:
    """Lab 03c, exercise 2: ring all-reduce time in microseconds, latency ignored."""
    link = link_gb_s_per_direction(gpu)
    expected = 1e6 * ring_all_reduce_s(num_bytes, tp, link)
    mistakes = {"used the datasheet's two-direction bandwidth, or forgot the factor 2 of "
                "reduce-scatter plus all-gather": expected / 2,
                "sent the whole buffer at every step": expected * tp}
    return check_number(answer, expected, what="ring all-reduce time", unit="us",
                        rel_tol=0.02, mistakes=mistakes)


def check_decode_allreduce_bytes(answer: object, model: str = "Llama-3-70B",
                                 batch_size: int = 1) -> Feedback:
    """Lab 03c, exercise 3: bytes each rank all-reduces per decode step, all layers."""
    spec = get_model(model)
    expected = spec.num_layers * allreduce_bytes_per_layer(spec, batch_size)
    mistakes = {"counted one all-reduce per layer instead of two": expected / 2,
                "counted one layer only": expected / spec.num_layers,
                "used 4 bytes per value": expected * 2}
    return check_number(answer, expected, what="all-reduce bytes per decode step",
                        unit="bytes", rel_tol=1e-9, mistakes=mistakes)


def check_radix_extra_tokens(answer: object, shared_prefix_len: int = 37,
                             block_size: int = 16) -> Feedback:
    """Lab 03a, stretch: shared-prefix tokens per request a radix tree serves that whole
    hashed blocks cannot."""
    expected = shared_prefix_len % block_size
    return check_number(answer, expected, what="extra tokens per request", rel_tol=0,
                        mistakes={"counted the blocks' tokens instead":
                                  shared_prefix_len - expected})
