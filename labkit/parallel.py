"""Tensor parallelism over simulated ranks, in NumPy (:ref:`ch03-tensor-parallelism`).

Each "rank" is a slice of the weights; collectives are functions over the ranks' arrays. The
Megatron recipe needs one all-reduce per block half: the first linear layer of the MLP (or the
q/k/v projections) is split by output columns, the second (or the output projection) by input
rows, so each rank's partial results add up to the single-device output. Costs come from the
ring algorithm over the link in chapter 1's GPU table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np

from labkit.attention import dense_attention
from labkit.checks import in_range, positive_int
from labkit.hardware import decode_step, get_gpu, get_model, kv_heads_per_rank, tp_shard
from labkit.hardware.gpus import GPU
from labkit.hardware.models import ModelSpec


def split_columns(w: np.ndarray, tp: int) -> list[np.ndarray]:
    """Cut ``w`` ``[in, out]`` into ``tp`` column blocks (column-parallel)."""
    tp_shard(w.shape[1], tp, "the output width", param="tp")
    return np.split(w, tp, axis=1)


def split_rows(w: np.ndarray, tp: int) -> list[np.ndarray]:
    """Cut ``w`` ``[in, out]`` into ``tp`` row blocks (row-parallel)."""
    tp_shard(w.shape[0], tp, "the input width", param="tp")
    return np.split(w, tp, axis=0)


def all_reduce(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every rank ends with the sum of all ranks' arrays."""
    total = np.sum(parts, axis=0)
    return [total.copy() for _ in parts]


def all_gather(parts: Sequence[np.ndarray], axis: int = -1) -> list[np.ndarray]:
    """Every rank ends with all ranks' arrays concatenated along ``axis``."""
    whole = np.concatenate(parts, axis=axis)
    return [whole.copy() for _ in parts]


def column_parallel_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                           tp: int) -> list[np.ndarray]:
    """``x @ w + b`` with ``w`` split by columns: rank ``r`` holds output columns ``r``.

    No communication: each rank's slice of the output is complete.
    """
    biases = np.split(b, tp) if b is not None else [0.0] * tp
    return [x @ wr + br for wr, br in zip(split_columns(w, tp), biases, strict=True)]


def row_parallel_linear(x_parts: Sequence[np.ndarray], w: np.ndarray, b: np.ndarray | None,
                        tp: int) -> list[np.ndarray]:
    """``x @ w + b`` with ``w`` split by rows, each rank holding the matching slice of ``x``.

    Partial products are summed by an all-reduce; the bias is added once, after it. (Adding it
    on every rank before the sum, as a naive port does, counts it ``tp`` times.)
    """
    partial = [xr @ wr for xr, wr in zip(x_parts, split_rows(w, tp), strict=True)]
    summed = all_reduce(partial)
    return [y + b for y in summed] if b is not None else summed


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """The single-device SwiGLU MLP of Llama-family models."""
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def megatron_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                 tp: int) -> list[np.ndarray]:
    """The MLP over ``tp`` ranks: gate/up column-parallel, down row-parallel, one all-reduce.

    SwiGLU is element-wise, so each rank applies it to its own columns with no exchange.
    """
    gate = column_parallel_linear(x, w_gate, None, tp)
    up = column_parallel_linear(x, w_up, None, tp)
    hidden = [silu(g) * u for g, u in zip(gate, up, strict=True)]
    return row_parallel_linear(hidden, w_down, None, tp)


def attention(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, wo: np.ndarray,
              num_heads: int, num_kv_heads: int) -> np.ndarray:
    """Single-device causal self-attention of ``x`` ``[tokens, hidden]``, GQA heads."""
    return attention_heads(x, wq, wk, wv, num_heads, num_kv_heads) @ wo


def tensor_parallel_attention(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray,
                              wo: np.ndarray, num_heads: int, num_kv_heads: int,
                              tp: int) -> list[np.ndarray]:
    """Attention split by heads: rank ``r`` owns ``num_heads / tp`` query heads and their KV
    heads (replicated when ``tp > num_kv_heads``); ``wo`` is row-parallel; one all-reduce."""
    heads = tp_shard(num_heads, tp, "num_heads", param="tp")
    kv_heads = kv_heads_per_rank(num_kv_heads, tp, param="tp")
    dim = wq.shape[1] // num_heads
    outputs = []
    for r in range(tp):
        q_cols = slice(r * heads * dim, (r + 1) * heads * dim)
        first_kv = r * heads * num_kv_heads // num_heads  # the KV head rank r's queries read
        kv_cols = slice(first_kv * dim, (first_kv + kv_heads) * dim)
        outputs.append(attention_heads(x, wq[:, q_cols], wk[:, kv_cols], wv[:, kv_cols],
                                       heads, kv_heads))
    return row_parallel_linear(outputs, wo, None, tp)


def attention_heads(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray,
                    num_heads: int, num_kv_heads: int) -> np.ndarray:
    """Attention output before ``wo``, ``[tokens, num_heads * head_dim]``."""
    t, dim = x.shape[0], wq.shape[1] // num_heads
    q = (x @ wq).reshape(t, num_heads, dim)
    k = (x @ wk).reshape(t, num_kv_heads, dim)
    v = (x @ wv).reshape(t, num_kv_heads, dim)
    return dense_attention(q, k, v).reshape(t, num_heads * dim)


def ring_all_reduce_bytes(num_bytes: float, tp: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``num_bytes`` per rank:
    ``2 (p-1)`` steps (reduce-scatter, then all-gather) each moving ``num_bytes / p``, so
    ``2 (p-1) / p`` times the buffer, nearly twice it on many ranks
    (:ref:`ch03-tensor-parallelism`)."""
    positive_int("tp", tp)
    in_range("num_bytes", num_bytes, 0)
    return 2 * (tp - 1) * num_bytes / tp


def ring_all_reduce_s(num_bytes: float, tp: int, link_gb_s: float,
                      latency_s: float = 0.0) -> float:
    """Time of a ring all-reduce of ``num_bytes`` per rank over links of ``link_gb_s``
    (GB/s per direction): :func:`ring_all_reduce_bytes` over the link, plus ``latency_s`` for
    each of the ``2 (p-1)`` steps.

    ``latency_s`` is the fixed cost of one step (launch and synchronisation); it dominates
    the small messages of decode. It is a parameter, not a measurement: measure yours.
    """
    in_range("link_gb_s", link_gb_s, 0, low_open=True)
    in_range("latency_s", latency_s, 0)
    sent = ring_all_reduce_bytes(num_bytes, tp)
    return sent / (link_gb_s * 1e9) + 2 * (tp - 1) * latency_s


def link_gb_s_per_direction(gpu: GPU | str) -> float:
    """Per-direction bandwidth of the GPU's link: datasheets count both directions."""
    return get_gpu(gpu).interconnect_gb_s / 2


#: All-reduces per decoder layer in the Megatron split: after attention's output projection
#: and after the MLP's down projection.
ALLREDUCES_PER_LAYER = 2


def allreduce_bytes(model: ModelSpec | str, num_tokens: int, act_bytes: int = 2) -> int:
    """Bytes of one all-reduce in a decoder layer: ``num_tokens`` rows of the hidden state
    (:ref:`ch03-tensor-parallelism`)."""
    return num_tokens * get_model(model).hidden_size * act_bytes


def allreduce_bytes_per_layer(model: ModelSpec | str, num_tokens: int,
                              act_bytes: int = 2) -> int:
    """Bytes each rank all-reduces per decoder layer: ``num_tokens`` rows of the hidden
    state after attention and again after the MLP."""
    return ALLREDUCES_PER_LAYER * allreduce_bytes(model, num_tokens, act_bytes)


@dataclass(frozen=True)
class TPStep:
    """One decode step's time split into the roofline part and communication."""

    tensor_parallel_size: int
    compute_s: float
    comm_s: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def tp_decode_scaling(model: ModelSpec | str, gpu: GPU | str, tp_sizes: Sequence[int],
                      batch_size: int, context_len: int, latency_s: float = 0.0,
                      weight_dtype: str = "bf16") -> list[TPStep]:
    """Decode step time for each TP size: the roofline bound per GPU plus the two ring
    all-reduces per layer, not overlapped (an upper bound on what communication costs)."""
    spec = get_model(model)
    link = link_gb_s_per_direction(gpu)
    message = allreduce_bytes(spec, batch_size)  # one BF16 activation row per sequence
    steps = []
    for tp in tp_sizes:
        bound = decode_step(spec, gpu, batch_size, context_len, weight_dtype,
                            tensor_parallel_size=tp)
        comm = (spec.num_layers * ALLREDUCES_PER_LAYER
                * ring_all_reduce_s(message, tp, link, latency_s))
        steps.append(TPStep(tp, bound.time_s, comm))
    return steps


def plot_tp_scaling(steps: Sequence[TPStep], ax=None, label: str = ""):
    """Stacked bars of roofline and communication time per TP size, speedup annotated."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    sizes = [str(s.tensor_parallel_size) for s in steps]
    compute = [1e3 * s.compute_s for s in steps]
    comm = [1e3 * s.comm_s for s in steps]
    ax.bar(sizes, compute, label="roofline (per GPU)")
    ax.bar(sizes, comm, bottom=compute, label="all-reduce")
    for x, s in zip(sizes, steps, strict=True):
        ax.annotate(f"{steps[0].time_s / s.time_s:.2f}x", (x, 1e3 * s.time_s),
                    ha="center", va="bottom", fontsize="small")
    ax.set_xlabel("tensor_parallel_size")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(label, fontsize="medium")
    ax.legend(fontsize="small")
    return ax
