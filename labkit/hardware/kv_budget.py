"""The vLLM view of GPU memory: how many KV blocks fit, and how many sequences
(:doc:`chapter 1 </chapters/ch01_gpu_selection>`).

At start-up vLLM loads the weights, runs one forward pass of ``max_num_batched_tokens``
dummy tokens to measure peak activations, and then hands the rest of its share of the GPU,
``gpu_memory_utilization * total``, to the KV cache, cut into blocks of ``block_size``
tokens. Its log then reports "GPU KV cache size: N tokens" and "Maximum concurrency for
``max_model_len`` tokens per request: X". This module predicts both numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.hardware.dtypes import default_kv_dtype, weight_format
from labkit.hardware.gpus import GPU, get_gpu
from labkit.hardware.memory import (
    DEFAULT_OVERHEAD_GIB,
    activation_bytes,
    kv_cache_bytes_per_token,
    weight_bytes,
)
from labkit.hardware.models import ModelSpec, get_model
from labkit.units import GiB, cdiv


class DoesNotFitError(ParameterError):
    """The model, at these settings, leaves no room for the KV cache vLLM needs (a
    ``ValueError``; ``param`` names the setting at fault when there is one)."""


def num_kv_blocks(budget_bytes: float, *, weights_bytes: float, activations_bytes: float,
                  block_bytes: int, overhead_bytes: float = 0.0) -> int:
    """Whole KV blocks that fit in what the weights, activations and overhead leave (chapter 1).

    vLLM's rule: its share of the device, ``gpu_memory_utilization * total``, minus the weights,
    the peak activations of the profiling run and the runtime overhead, rounded down to whole
    blocks of ``block_bytes`` (``block_size`` tokens of KV over all layers); none when nothing
    is left.
    """
    free = budget_bytes - weights_bytes - activations_bytes - overhead_bytes
    return max(0, int(free // block_bytes))


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """vLLM's "Maximum concurrency for ``max_model_len`` tokens per request" (chapter 1).

    A request of ``max_model_len`` tokens takes whole blocks, ``cdiv(max_model_len,
    block_size)`` of them, so the cache of ``num_blocks`` blocks holds ``num_blocks`` over that
    many such requests, a fraction in general. It is vLLM 0.32's
    ``get_max_concurrency_for_kv_cache_config`` (``vllm/v1/core/kv_cache_utils.py``) for one
    full-attention group: ``cdiv`` of the spec's ``max_memory_usage_bytes`` (``cdiv(max_model_len,
    block_size)`` pages) by the page size. vLLM logs it with two decimals ("X.XXx") and reports
    ``int(max_concurrency * max_model_len)`` as the "KV cache size" in tokens.
    """
    positive_int("num_blocks", num_blocks, at_least=0)
    return num_blocks / cdiv(positive_int("max_model_len", max_model_len),
                             positive_int("block_size", block_size))


def check_sequence_fits(num_tokens: int, num_blocks: int, block_size: int, what: str,
                        remedy: str = "", param: str | None = None) -> None:
    """Raise :class:`DoesNotFitError` if one sequence of ``num_tokens`` tokens needs more KV
    blocks than the whole cache has: it could never run (chapter 1).

    vLLM refuses to start when ``max_model_len`` does not fit; a scheduler refuses a request
    that does not. ``what`` names the sequence in the message, ``remedy`` says what to change
    and ``param`` is the parameter at fault, if any.
    """
    needed = cdiv(num_tokens, block_size)
    if needed > num_blocks:
        raise DoesNotFitError(
            param,
            f"{what} needs {needed} blocks of {block_size} tokens, more than the cache's "
            f"{num_blocks} blocks (only {num_blocks * block_size} tokens fit)"
            + (f". {remedy}" if remedy else ""))


def vllm_batch_defaults(gpu: GPU | str, offline: bool = False) -> tuple[int, int]:
    """vLLM's default ``(max_num_batched_tokens, max_num_seqs)`` for a GPU (chapter 1).

    Mirrors ``EngineArgs.get_batch_defaults``: GPUs with at least 70 GiB other than the A100
    get 8192 tokens and 1024 sequences for ``vllm serve`` (16384 tokens for the offline
    ``LLM`` class); the rest get 2048 (8192 offline) and 256.
    """
    gpu = get_gpu(gpu)
    if gpu.memory_gib >= 70 and "a100" not in gpu.name.lower():
        return (16384 if offline else 8192), 1024
    return (8192 if offline else 2048), 256


@dataclass(frozen=True)
class KVCachePlan:
    """What vLLM would allocate on each GPU, in GiB and blocks (chapter 1)."""

    model: str
    gpu: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    block_size: int
    max_model_len: int
    weight_dtype: str
    kv_dtype: str
    budget_gib: float
    weights_gib: float
    activations_gib: float
    overhead_gib: float
    block_bytes: int
    num_gpu_blocks: int

    @property
    def kv_cache_gib(self) -> float:
        """Memory the blocks take (the budget's remainder, rounded down to whole blocks)."""
        return self.num_gpu_blocks * self.block_bytes / GiB

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens"."""
        return self.num_gpu_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"
        (:func:`max_concurrency`)."""
        return max_concurrency(self.num_gpu_blocks, self.block_size, self.max_model_len)

    @property
    def headroom(self) -> float:
        """Share of the budget left for the KV cache; low means tight."""
        return self.kv_cache_gib / self.budget_gib

    def __str__(self) -> str:
        return (
            f"{self.model} on {self.tensor_parallel_size} x {self.gpu}, per GPU\n"
            f"  (weights {self.weight_dtype}, KV cache {self.kv_dtype}, "
            f"gpu_memory_utilization={self.gpu_memory_utilization})\n"
            f"  budget      {self.budget_gib:8.2f} GiB\n"
            f"  weights     {self.weights_gib:8.2f} GiB\n"
            f"  activations {self.activations_gib:8.2f} GiB\n"
            f"  overhead    {self.overhead_gib:8.2f} GiB\n"
            f"  KV cache    {self.kv_cache_gib:8.2f} GiB = {self.num_gpu_blocks:,} blocks of "
            f"{self.block_size} tokens = {self.kv_cache_tokens:,} tokens\n"
            f"  max concurrency at {self.max_model_len:,} tokens: {self.max_concurrency:.2f}x"
        )


def plan_kv_cache(model: ModelSpec | str, gpu: GPU | str, tensor_parallel_size: int = 1,
                  gpu_memory_utilization: float = 0.9, block_size: int = 16,
                  max_model_len: int | None = None, weight_dtype: str = "bf16",
                  kv_dtype: str | None = None, max_num_batched_tokens: int | None = None,
                  max_num_seqs: int | None = None,
                  overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> KVCachePlan:
    """Predict vLLM's KV-cache allocation on ``tensor_parallel_size`` GPUs (chapter 1).

    ``max_model_len`` defaults to the model's ``max_position_embeddings``; the batch limits
    default to :func:`vllm_batch_defaults`. Raises :class:`DoesNotFitError` (a ``ValueError``)
    where vLLM would refuse to start: no memory left for blocks, or not enough blocks for one
    sequence of ``max_model_len`` tokens.
    """
    model, gpu = get_model(model), get_gpu(gpu)
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    positive_int("block_size", block_size)
    max_model_len = positive_int("max_model_len", max_model_len or model.max_position_embeddings)
    default_tokens, default_seqs = vllm_batch_defaults(gpu)
    max_num_batched_tokens = max_num_batched_tokens or default_tokens
    max_num_seqs = max_num_seqs or default_seqs
    fmt = weight_format(weight_dtype)
    kv_dtype = kv_dtype or default_kv_dtype(fmt)
    tp = tensor_parallel_size

    budget = gpu.memory_bytes * gpu_memory_utilization
    weights = weight_bytes(model, fmt, tp)
    activations = activation_bytes(model, max_num_batched_tokens, max_num_seqs, tp)
    overhead = overhead_gib * GiB
    if budget <= weights + activations + overhead:
        raise DoesNotFitError(
            None,
            f"No available memory for the cache blocks: {model.name} needs "
            f"{(weights + activations + overhead) / GiB:.1f} GiB per GPU before any KV cache, "
            f"but {gpu_memory_utilization} x {gpu.name} gives {budget / GiB:.1f} GiB. "
            f"Use more GPUs (tensor_parallel_size), a smaller weight_dtype or a larger "
            f"gpu_memory_utilization."
        )
    block_bytes = block_size * kv_cache_bytes_per_token(model, kv_dtype, tp)
    num_blocks = num_kv_blocks(budget, weights_bytes=weights, activations_bytes=activations,
                               overhead_bytes=overhead, block_bytes=block_bytes)
    check_sequence_fits(max_model_len, num_blocks, block_size, f"max_model_len={max_model_len}",
                        "Lower max_model_len or free memory (more GPUs, fp8 KV cache, "
                        "quantized weights).", param="max_model_len")
    return KVCachePlan(
        model=model.name, gpu=gpu.name, tensor_parallel_size=tp,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        max_model_len=max_model_len, weight_dtype=fmt.name, kv_dtype=kv_dtype,
        budget_gib=budget / GiB, weights_gib=weights / GiB, activations_gib=activations / GiB,
        overhead_gib=overhead_gib, block_bytes=block_bytes, num_gpu_blocks=num_blocks,
    )
