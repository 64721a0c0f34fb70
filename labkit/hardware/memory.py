"""How much GPU memory a model needs to serve: weights, KV cache, activations
(:ref:`ch01-what-fits`).

All functions count bytes exactly from the model's shape and report GiB (2**30 bytes), the
unit ``nvidia-smi`` and vLLM's logs use. Sizes are per GPU when ``tensor_parallel_size > 1``:
vLLM shards every linear layer and the (vocab-parallel) embedding across the ranks, and splits
the KV heads, replicating them when there are fewer KV heads than ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.hardware.dtypes import WeightFormat, default_kv_dtype, kv_dtype_bytes, weight_format
from labkit.hardware.gpus import GPU, get_gpu
from labkit.hardware.models import ModelSpec, get_model
from labkit.units import GiB

#: CUDA context, cuBLAS/NCCL workspaces and the CUDA-graph pool, per GPU. An assumption, not
#: a measurement: vLLM logs its own figure at start-up ("non-torch memory", "CUDA graph"), and
#: a deployment should put that number here.
DEFAULT_OVERHEAD_GIB = 1.0


def tp_shard(size: int, tensor_parallel_size: int, what: str,
             param: str = "tensor_parallel_size") -> int:
    """The share of ``size`` (heads, a layer's width) each of ``tensor_parallel_size`` ranks
    holds (chapter 1 and :ref:`ch03-tensor-parallelism`).

    vLLM splits attention heads and linear layers evenly (its ``divide``), so the TP size must
    divide ``size``. ``what`` names the size in the message, ``param`` the caller's TP argument.
    """
    positive_int(param, tensor_parallel_size)
    if size % tensor_parallel_size:
        raise ParameterError(param, f"{param} ({tensor_parallel_size}) must divide {what} "
                                    f"({size})")
    return size // tensor_parallel_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int,
                      param: str = "tensor_parallel_size") -> int:
    """KV heads each rank stores: split when the TP size divides them, one replicated head per
    rank when they divide the TP size; any other pair is refused (chapter 1 and
    :ref:`ch03-tensor-parallelism`)."""
    tp = positive_int(param, tensor_parallel_size)
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ParameterError(param, f"{param} ({tp}) and num_kv_heads ({num_kv_heads}) must "
                                    f"divide one another")
    return max(1, num_kv_heads // tp)


def check_tensor_parallel(model: ModelSpec, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` unless vLLM could shard ``model`` over this many GPUs (chapter 1):
    the attention heads, the KV heads and the MLP's intermediate size must split evenly."""
    tp_shard(model.num_attention_heads, tensor_parallel_size, "num_attention_heads")
    kv_heads_per_rank(model.num_kv_heads, tensor_parallel_size)
    tp_shard(model.intermediate_size, tensor_parallel_size, "intermediate_size")


def kv_cache_bytes_per_token(model: ModelSpec | str, kv_dtype: str = "bf16",
                             tensor_parallel_size: int = 1) -> int:
    """Bytes of KV cache one token occupies on one GPU, over all layers (:ref:`ch01-what-fits`).

    ``2 (K and V) * num_layers * num_kv_heads * head_dim * bytes(kv_dtype)``: the KV heads,
    not the attention heads, which is the whole saving of grouped-query attention.
    """
    model = get_model(model)
    check_tensor_parallel(model, tensor_parallel_size)
    heads = kv_heads_per_rank(model.num_kv_heads, tensor_parallel_size)
    return 2 * model.num_layers * heads * model.head_dim * kv_dtype_bytes(kv_dtype)


def weight_bytes(model: ModelSpec | str, weight_dtype: str | WeightFormat = "bf16",
                 tensor_parallel_size: int = 1) -> float:
    """Bytes of weights on one GPU (:ref:`ch01-what-fits`).

    Quantized formats shrink only the decoder's linear layers; embedding, LM head and norms
    stay 16-bit. Norms are replicated on every rank, everything else is split evenly.
    """
    model = get_model(model)
    check_tensor_parallel(model, tensor_parallel_size)
    fmt = weight_format(weight_dtype)
    counts = model.param_counts()
    if fmt.quantized:
        linear_bytes = counts.linear * fmt.bits_per_weight / 8
        sharded = linear_bytes + (counts.embedding + counts.lm_head) * 2
        replicated = counts.norms * 2
    else:
        sharded = (counts.total - counts.norms) * fmt.bits / 8
        replicated = counts.norms * fmt.bits / 8
    return sharded / tensor_parallel_size + replicated


def activation_bytes(model: ModelSpec | str, num_tokens: int, num_seqs: int,
                     tensor_parallel_size: int = 1, act_dtype_bytes: int = 2) -> float:
    """Peak activation working set of a forward pass over ``num_tokens`` tokens
    (:ref:`ch01-what-fits`).

    An estimate of what vLLM's start-up profiling run measures: the largest layer's live
    tensors (residual and normed input ``2*H``, the q/k/v projection, the MLP's gate+up
    output and its activated half ``3*I`` per routed expert, split over the ranks) for every
    token, plus FP32 logits for the ``num_seqs`` sequences that sample a token.
    """
    model = get_model(model)
    check_tensor_parallel(model, tensor_parallel_size)
    positive_int("num_tokens", num_tokens)
    positive_int("num_seqs", num_seqs)
    tp = tensor_parallel_size
    qkv = (model.q_size + 2 * model.kv_size) / tp
    mlp = 3 * model.intermediate_size * model.experts_per_token / tp
    per_token = (2 * model.hidden_size + qkv + mlp) * act_dtype_bytes
    logits = min(num_seqs, num_tokens) * model.vocab_size * 4
    return num_tokens * per_token + logits


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory needed per GPU, in GiB (:ref:`ch01-what-fits`)."""

    model: str
    weight_dtype: str
    kv_dtype: str
    seq_len: int
    batch_size: int
    tensor_parallel_size: int
    weights_gib: float
    kv_cache_gib: float
    activations_gib: float
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_cache_gib + self.activations_gib + self.overhead_gib

    def fits(self, gpu: GPU | str, gpu_memory_utilization: float = 0.9) -> bool:
        """Whether the total fits in the share of one GPU's memory an engine may use."""
        return self.total_gib <= get_gpu(gpu).memory_gib * gpu_memory_utilization

    def rows(self) -> list[tuple[str, float]]:
        return [("weights", self.weights_gib), ("KV cache", self.kv_cache_gib),
                ("activations", self.activations_gib), ("runtime overhead", self.overhead_gib),
                ("total", self.total_gib)]

    def __str__(self) -> str:
        head = (f"{self.model}, weights {self.weight_dtype}, KV {self.kv_dtype}, "
                f"{self.batch_size} x {self.seq_len} tokens, "
                f"TP={self.tensor_parallel_size} (per GPU)")
        return "\n".join([head] + [f"  {k:<17}{v:9.2f} GiB" for k, v in self.rows()])


def estimate_vram(model: ModelSpec | str, weight_dtype: str = "bf16", kv_dtype: str | None = None,
                  seq_len: int = 4096, batch_size: int = 1, tensor_parallel_size: int = 1,
                  max_num_batched_tokens: int | None = None,
                  overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> MemoryEstimate:
    """Memory per GPU to hold ``batch_size`` sequences of ``seq_len`` tokens
    (:ref:`ch01-what-fits`).

    ``kv_dtype=None`` means vLLM's ``"auto"``: the activation dtype (BF16), whatever the
    weights are stored in. ``max_num_batched_tokens`` caps the tokens of one forward pass,
    as chunked prefill does; ``None`` prefills the whole batch at once.
    """
    model = get_model(model)
    positive_int("seq_len", seq_len)
    positive_int("batch_size", batch_size)
    if max_num_batched_tokens is not None:
        positive_int("max_num_batched_tokens", max_num_batched_tokens)
    in_range("overhead_gib", overhead_gib, 0)
    fmt = weight_format(weight_dtype)
    kv_dtype = kv_dtype or default_kv_dtype(fmt)
    tp = tensor_parallel_size
    step_tokens = seq_len * batch_size
    if max_num_batched_tokens is not None:
        step_tokens = min(step_tokens, max_num_batched_tokens)
    act_bytes = 4 if fmt.name == "fp32" else 2
    return MemoryEstimate(
        model=model.name, weight_dtype=fmt.name, kv_dtype=kv_dtype, seq_len=seq_len,
        batch_size=batch_size, tensor_parallel_size=tp,
        weights_gib=weight_bytes(model, fmt, tp) / GiB,
        kv_cache_gib=kv_cache_bytes_per_token(model, kv_dtype, tp) * seq_len * batch_size / GiB,
        activations_gib=activation_bytes(model, step_tokens, batch_size, tp, act_bytes) / GiB,
        overhead_gib=overhead_gib,
    )
