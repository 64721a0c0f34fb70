"""Checks for the exercises of lab 01 (chapter 1). Each knows the usual mistakes."""

from __future__ import annotations

from dataclasses import replace

from labkit.grading import Feedback, check_number
from labkit.hardware.dtypes import kv_dtype_bytes, weight_format
from labkit.hardware.gpus import get_gpu
from labkit.hardware.kv_budget import plan_kv_cache
from labkit.hardware.memory import kv_cache_bytes_per_token, weight_bytes
from labkit.hardware.models import get_model
from labkit.hardware.roofline import decode_step
from labkit.units import GB, GiB


def check_kv_bytes_per_token(answer: object, model: str = "Llama-3-70B",
                             kv_dtype: str = "bf16") -> Feedback:
    """Exercise 1: bytes of KV cache per token, all layers."""
    m = get_model(model)
    expected = kv_cache_bytes_per_token(m, kv_dtype)
    per_layer_head = m.head_dim * kv_dtype_bytes(kv_dtype)
    mistakes = {
        "used the attention heads instead of the KV heads (grouped-query attention)":
            2 * m.num_layers * m.num_attention_heads * per_layer_head,
        "forgot the factor 2 for K and V": expected / 2,
        "counted one layer only": expected / m.num_layers,
    }
    if kv_dtype in ("bf16", "fp16"):
        mistakes["used 1 byte per element (FP8) instead of 2"] = expected / 2
        mistakes["used 4 bytes per element (FP32) instead of 2"] = expected * 2
    return check_number(answer, expected, what=f"KV bytes per token of {m.name} in {kv_dtype}",
                        unit="bytes", rel_tol=1e-6, mistakes=mistakes)


def check_weights_gib(answer: object, model: str = "Llama-3-8B",
                      weight_dtype: str = "int4-awq") -> Feedback:
    """Exercise 2: GiB of weights on one GPU."""
    m = get_model(model)
    fmt = weight_format(weight_dtype)
    expected = weight_bytes(m, fmt) / GiB
    mistakes = {
        "quantized the embedding and LM head too (they stay 16-bit)":
            m.num_params * fmt.bits_per_weight / 8 / GiB,
        "left out the group scales and zero points":
            weight_bytes(m, replace(fmt, group_size=None)) / GiB,
        "used the nominal size in the name and bits only":
            _nominal_params(m.name) * fmt.bits / 8 / GiB,
    }
    return check_number(answer, expected, what=f"{m.name} {fmt.name} weights", unit="GiB",
                        rel_tol=0.005, mistakes=mistakes)


def check_max_concurrency(answer: object, model: str = "Llama-3-8B", gpu: str = "L40S",
                          max_model_len: int = 8192, gpu_memory_utilization: float = 0.9,
                          **plan_options) -> Feedback:
    """Exercise 3: vLLM's maximum concurrency for full-length requests."""
    plan = plan_kv_cache(model, gpu, max_model_len=max_model_len,
                         gpu_memory_utilization=gpu_memory_utilization, **plan_options)
    blocks = plan.num_gpu_blocks
    mistakes = {
        "ignored gpu_memory_utilization": plan_kv_cache(
            model, gpu, max_model_len=max_model_len, gpu_memory_utilization=1.0,
            **plan_options).max_concurrency,
        "divided KV tokens by max_model_len without rounding it up to whole blocks":
            plan.kv_cache_tokens / max_model_len,
        "counted a sequence as one block": float(blocks),
    }
    return check_number(answer, plan.max_concurrency, what="maximum concurrency", unit="x",
                        rel_tol=0.02, mistakes=mistakes)


def check_decode_tokens_per_s(answer: object, model: str = "Llama-3-8B", gpu: str = "H100 SXM",
                              batch_size: int = 1, context_len: int = 1024) -> Feedback:
    """Exercise 4: upper bound on decode tokens/s from the roofline."""
    step = decode_step(model, gpu, batch_size, context_len)
    kv_bytes = kv_cache_bytes_per_token(model) * batch_size * context_len
    mistakes = {
        "used the compute roof (decode at this batch is memory-bound)":
            batch_size / step.compute_s,
        "forgot to read the KV cache":
            batch_size / ((step.bytes_moved - kv_bytes) / get_gpu(gpu).mem_bandwidth_bytes_s),
        "counted GB/s as GiB/s": step.tokens_per_s * GiB / GB,
    }
    return check_number(answer, step.tokens_per_s, what="decode tokens/s bound", unit="tok/s",
                        rel_tol=0.05, mistakes=mistakes)


def _nominal_params(name: str) -> float:
    """The '8B' in 'Llama-3-8B' as a parameter count (the naive reading)."""
    token = [t for t in name.replace("x", "-").split("-") if t.endswith("B")][-1]
    return float(token[:-1]) * 1e9


def check_largest_max_model_len(answer: object, model: str = "Llama-3-70B", gpu: str = "L40S",
                                tensor_parallel_size: int = 2, weight_dtype: str = "int4-awq",
                                concurrency: int = 8, block_size: int = 16) -> Feedback:
    """Stretch: the largest ``max_model_len`` at which ``concurrency`` full sequences fit.

    The number of blocks does not depend on ``max_model_len``; each sequence needs
    ``ceil(max_model_len / block_size)`` of them, so the answer is a multiple of the block size.
    """
    plan = plan_kv_cache(model, gpu, tensor_parallel_size, block_size=block_size,
                         max_model_len=block_size, weight_dtype=weight_dtype)
    expected = block_size * (plan.num_gpu_blocks // concurrency)
    mistakes = {
        "divided the KV tokens evenly, ignoring that a sequence holds whole blocks":
            plan.kv_cache_tokens / concurrency,
        "sized the KV cache with the weights' precision (4 bits instead of 16)":
            block_size * (plan.num_gpu_blocks * 4 // concurrency),
    }
    return check_number(answer, expected, what="largest max_model_len", unit="tokens",
                        rel_tol=1e-9, mistakes=mistakes)
