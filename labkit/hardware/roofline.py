"""Roofline bounds for prefill and decode (:doc:`chapter 1 </chapters/ch01_gpu_selection>`).

A step of the engine can go no faster than its FLOPs at the GPU's peak tensor throughput, nor
faster than its bytes at peak memory bandwidth: ``time >= max(FLOPs / peak, bytes / BW)``.
Decode reads every weight to produce one token per sequence, so at small batch it is bound by
bandwidth; prefill multiplies each weight by thousands of tokens and is bound by compute.
These are lower bounds on time (upper bounds on tokens/s); ``benchmarks/gpu_check.py`` measures
how close a real decode step comes on a GPU.
Communication between tensor-parallel ranks is left out here; chapter 3 adds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, positive_int
from labkit.hardware.dtypes import weight_format
from labkit.hardware.gpus import GPU, get_gpu
from labkit.hardware.memory import check_tensor_parallel, kv_cache_bytes_per_token
from labkit.hardware.models import ModelSpec, get_model


@dataclass(frozen=True)
class StepBound:
    """Lower bound on one engine step's time, per GPU; FLOPs and bytes per GPU too (chapter 1)."""

    flops: float
    bytes_moved: float
    compute_s: float
    memory_s: float
    tokens: int

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof the step sits under."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes_moved

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on tokens produced (decode) or processed (prefill) per second."""
        return self.tokens / self.time_s


def _expected_experts_touched(model: ModelSpec, num_tokens: int) -> float:
    """Experts per layer at least one of ``num_tokens`` tokens is routed to (uniform routing)."""
    if not model.is_moe:
        return 1.0
    miss = (1 - model.experts_per_token / model.num_experts) ** num_tokens
    return model.num_experts * (1 - miss)


def _weight_traffic(model: ModelSpec, weight_dtype: str, num_tokens: int) -> float:
    """Bytes of weights one forward pass over ``num_tokens`` tokens reads (whole model).

    Every linear layer once, only the experts some token was routed to, the LM head once,
    and of the embedding table only the rows of the tokens looked up.
    """
    fmt = weight_format(weight_dtype)
    c = model.param_counts()
    linear_bytes = fmt.bits_per_weight / 8 if fmt.quantized else fmt.bits / 8
    other_bytes = 2 if fmt.quantized else fmt.bits / 8
    experts_read = c.mlp / model.num_experts * _expected_experts_touched(model, num_tokens)
    linear = (c.attention + c.router + experts_read) * linear_bytes
    lm_head = (c.lm_head or c.embedding) * other_bytes
    embedding_rows = 0 if model.tie_word_embeddings else num_tokens * model.hidden_size
    embedding_rows *= other_bytes
    return linear + lm_head + embedding_rows + c.norms * other_bytes


def _matmul_flops_per_token(model: ModelSpec) -> float:
    """2 FLOPs per multiply-add over the active linear weights and the LM head."""
    c = model.param_counts()
    return 2 * (c.attention + c.router + c.active_mlp + (c.lm_head or c.embedding))


def _attention_flops(model: ModelSpec, query_tokens: int, context_len: int) -> float:
    """QK^T and AV for ``query_tokens`` new tokens each attending to ``context_len`` tokens."""
    return 4 * model.num_layers * model.q_size * query_tokens * context_len


def _step(gpu: GPU, weight_dtype: str, flops: float, bytes_moved: float, tokens: int,
          tp: int) -> StepBound:
    peak = gpu.peak_ops_s(_compute_dtype(weight_dtype))
    flops, bytes_moved = flops / tp, bytes_moved / tp
    return StepBound(flops=flops, bytes_moved=bytes_moved, compute_s=flops / peak,
                     memory_s=bytes_moved / gpu.mem_bandwidth_bytes_s, tokens=tokens)


def _compute_dtype(weight_dtype: str) -> str:
    compute = weight_format(weight_dtype).compute_dtype
    if compute == "fp32":
        raise ParameterError("weight_dtype", "weight_dtype: roofline bounds use tensor-core "
                                             "peaks; fp32 has none here")
    return compute


def step_bound(model: ModelSpec | str, gpu: GPU | str, rows: Sequence[tuple[int, int]],
               weight_dtype: str = "bf16", kv_dtype: str = "bf16",
               tensor_parallel_size: int = 1) -> StepBound:
    """Bound on one engine step over a mixed batch (chapter 1; the simulator's cost in
    :ref:`ch03-simulating`).

    ``rows`` holds ``(new_tokens, context_before)`` per sequence: a decode is ``(1, c)``, a
    prefill chunk ``(n, c)``. New token ``j`` of a row attends to ``c + j`` tokens (causal),
    every row reads its ``c`` cached tokens' K/V and writes ``n`` new ones, and the weights
    are read once for the whole step.
    """
    model, gpu = get_model(model), get_gpu(gpu)
    check_tensor_parallel(model, tensor_parallel_size)
    if not rows or any(n < 1 or c < 0 for n, c in rows):
        raise ParameterError("rows", "rows must be a non-empty list of (new_tokens >= 1, "
                                     "context >= 0)")
    tokens = sum(n for n, _ in rows)
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in rows)
    kv_tokens = sum(n + c for n, c in rows)
    flops = _matmul_flops_per_token(model) * tokens + _attention_flops(model, 1, 1) * pairs
    bytes_moved = (_weight_traffic(model, weight_dtype, tokens)
                   + kv_cache_bytes_per_token(model, kv_dtype) * kv_tokens)
    return _step(gpu, weight_dtype, flops, bytes_moved, tokens, tensor_parallel_size)


def decode_step(model: ModelSpec | str, gpu: GPU | str, batch_size: int, context_len: int,
                weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                tensor_parallel_size: int = 1) -> StepBound:
    """Bound on one decode step of ``batch_size`` sequences with ``context_len`` tokens (chapter 1).

    Each sequence attends to ``context_len`` tokens, its new one included. Bytes: the weights
    the step touches plus every sequence's KV cache. FLOPs: ``2 x`` active parameters per
    sequence plus attention over the context.
    """
    positive_int("batch_size", batch_size)
    positive_int("context_len", context_len)
    return step_bound(model, gpu, [(1, context_len - 1)] * batch_size, weight_dtype, kv_dtype,
                      tensor_parallel_size)


def prefill_step(model: ModelSpec | str, gpu: GPU | str, prompt_len: int, batch_size: int = 1,
                 weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 tensor_parallel_size: int = 1) -> StepBound:
    """Bound on prefilling ``batch_size`` prompts of ``prompt_len`` tokens at once (chapter 1).

    Causal attention: token ``i`` attends to ``i`` tokens, ``P(P+1)/2`` pairs per prompt.
    Bytes: the weights once plus the KV cache written for every prompt token.
    """
    positive_int("batch_size", batch_size)
    positive_int("prompt_len", prompt_len)
    return step_bound(model, gpu, [(prompt_len, 0)] * batch_size, weight_dtype, kv_dtype,
                      tensor_parallel_size)


def decode_compute_bound_batch(model: ModelSpec | str, gpu: GPU | str, context_len: int,
                               weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                               max_batch: int = 1 << 20) -> int | None:
    """Smallest decode batch that is compute-bound, or None up to ``max_batch`` (chapter 1).

    With a long context each extra sequence brings its own KV bytes, so the intensity levels
    off below the ridge point and decode never becomes compute-bound: then this returns None.
    """
    def compute_bound(b: int) -> bool:
        return decode_step(model, gpu, b, context_len, weight_dtype, kv_dtype).bound == "compute"

    if not compute_bound(max_batch):
        return None
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
