"""Paged attention in NumPy (chapter 3.1).

K and V live in a pool of fixed-size blocks, ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a sequence's block table says which physical block holds its logical block ``i``.
Attention gathers K and V through that table and must give exactly what dense attention gives
on the same tokens, grouped-query heads included. That equality is the whole contract of
PagedAttention: the paging is invisible to the maths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from labkit.units import cdiv


class PagedKVStore:
    """The K and V block pools of one attention layer."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)

    def slots(self, block_table: Sequence[int], start: int,
              stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) of token positions ``start..stop-1`` through the block table."""
        positions = np.arange(start, stop)
        logical, offsets = np.divmod(positions, self.block_size)
        if stop > len(block_table) * self.block_size:
            raise ValueError(f"positions up to {stop} need more than {len(block_table)} blocks")
        return np.asarray(block_table)[logical], offsets

    def write(self, block_table: Sequence[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V of tokens at positions ``start, start+1, ...`` (``[tokens, heads, dim]``)."""
        blocks, offsets = self.slots(block_table, start, start + len(k))
        self.k[blocks, offsets] = k
        self.v[blocks, offsets] = v

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst``: copy-on-write of a forked sequence's last,
        partly filled block (chapter 3.1), so each fork can append to its own copy."""
        for src, dst in copies:
            self.k[dst] = self.k[src]
            self.v[dst] = self.v[src]

    def gather(self, block_table: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of the first ``length`` tokens of a sequence, ``[length, heads, dim]``."""
        blocks, offsets = self.slots(block_table, 0, length)
        return self.k[blocks, offsets], self.v[blocks, offsets]


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    q_start: int | None = None) -> np.ndarray:
    """Causal attention for ``q`` ``[n, heads, dim]`` over ``k``/``v`` ``[ctx, kv_heads, dim]``.

    Query ``i`` sits at position ``q_start + i`` (default: the last ``n`` positions) and sees
    keys at positions up to its own. With ``heads = g * kv_heads``, query head ``h`` reads KV
    head ``h // g`` (grouped-query attention).
    """
    n, heads, dim = q.shape
    ctx, kv_heads, _ = k.shape
    group = _gqa_group(heads, kv_heads)
    q_start = ctx - n if q_start is None else q_start
    k = np.repeat(k, group, axis=1)  # [ctx, heads, dim]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,chd->hnc", q, k) / np.sqrt(dim)
    visible = np.arange(ctx)[None, :] <= (q_start + np.arange(n))[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hnc,chd->nhd", weights, v)


def paged_attention(q: np.ndarray, store: PagedKVStore, block_table: Sequence[int],
                    context_len: int) -> np.ndarray:
    """Attention of ``q`` (the sequence's last ``len(q)`` tokens) over its paged K/V.

    Like vLLM's kernel, it walks the block table one block at a time and never builds a
    contiguous K: an online softmax keeps, per query and head, the running maximum score
    ``m``, the running sum of ``exp(score - m)`` and the weighted sum of V, rescaling both
    whenever ``m`` grows.
    """
    n, heads, dim = q.shape
    group, bs = _gqa_group(heads, store.k.shape[2]), store.block_size
    if not 1 <= n <= context_len:
        raise ValueError(f"need 1 <= len(q) <= context_len, got {n} and {context_len}")
    q_pos = context_len - n + np.arange(n)
    qh = q.transpose(1, 0, 2) / np.sqrt(dim)  # [heads, n, dim]
    running_max = np.full((heads, n), -np.inf)
    denom = np.zeros((heads, n))
    acc = np.zeros((heads, n, dim))
    for i in range(cdiv(context_len, bs)):
        start = i * bs
        length = min(bs, context_len - start)
        k = np.repeat(store.k[block_table[i], :length], group, axis=1).transpose(1, 2, 0)
        v = np.repeat(store.v[block_table[i], :length], group, axis=1).transpose(1, 0, 2)
        scores = qh @ k  # [heads, n, length]
        visible = (start + np.arange(length))[None, :] <= q_pos[:, None]
        scores = np.where(visible[None], scores, -np.inf)
        new_max = np.maximum(running_max, scores.max(axis=-1))  # finite from block 0 on
        rescale = np.exp(running_max - new_max)
        p = np.exp(scores - new_max[..., None])
        denom = denom * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + p @ v
        running_max = new_max
    return (acc / denom[..., None]).transpose(1, 0, 2)


def _gqa_group(heads: int, kv_heads: int) -> int:
    """Query heads per KV head (grouped-query attention); they must divide evenly."""
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    return heads // kv_heads
