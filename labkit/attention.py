"""Paged attention in NumPy (:ref:`ch03-paged-attention`).

K and V live in a pool of fixed-size blocks, ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a sequence's block table says which physical block holds its logical block ``i``.
Attention gathers K and V through that table and must give exactly what dense attention gives
on the same tokens, grouped-query heads included. That equality is the whole contract of
PagedAttention: the paging is invisible to the maths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from labkit.checks import ParameterError
from labkit.units import cdiv


class PagedKVStore:
    """The K and V block pools of one attention layer."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)

    def slot_mapping(self, block_table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """The cache slot of each token position ``start..stop-1``: ``block * block_size +
        offset`` through the block table (vLLM's ``slot_mapping``)."""
        if stop > len(block_table) * self.block_size:
            raise ParameterError("block_table", f"block_table: positions up to {stop} need more "
                                                f"than {len(block_table)} blocks")
        logical, offsets = np.divmod(np.arange(start, stop), self.block_size)
        return np.asarray(block_table, dtype=np.int64)[logical] * self.block_size + offsets

    def write(self, block_table: Sequence[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V of tokens at positions ``start, start+1, ...`` (``[tokens, heads, dim]``)."""
        self.write_slots(self.slot_mapping(block_table, start, start + len(k)), k, v)

    def write_slots(self, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V row ``i`` in slot ``slots[i]``: the whole step's tokens in one scatter,
        as vLLM's ``reshape_and_cache`` does."""
        # The pools are contiguous, so these reshapes are views of them, not copies.
        self.k.reshape(-1, *self.k.shape[2:])[slots] = k
        self.v.reshape(-1, *self.v.shape[2:])[slots] = v

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst``: copy-on-write of a forked sequence's last,
        partly filled block (:ref:`ch03-paged-attention`), so each fork can append to its
        own copy."""
        for src, dst in copies:
            self.k[dst] = self.k[src]
            self.v[dst] = self.v[src]


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
                    context_len: int, tile_tokens: int = 256) -> np.ndarray:
    """Attention of ``q`` (the sequence's last ``len(q)`` tokens) over its paged K/V.

    One sequence of :func:`batched_paged_attention`: ``q`` is ``[n, heads, dim]``.
    """
    if not 1 <= len(q) <= context_len:
        raise ParameterError("q", f"q must have 1 to context_len ({context_len}) tokens, got "
                                  f"{len(q)}")
    return batched_paged_attention(q[None], store, [block_table], [context_len],
                                   tile_tokens)[0]


def batched_paged_attention(q: np.ndarray, store: PagedKVStore,
                            block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                            tile_tokens: int = 256) -> np.ndarray:
    """Attention of ``S`` sequences at once, each through its own block table.

    ``q`` is ``[S, n, heads, dim]``: the last ``n`` tokens of each sequence (``n = 1`` for a
    batch of decodes). Like vLLM's kernel, it never builds a contiguous K per sequence: it
    walks the block tables a tile of blocks at a time, gathering that tile's blocks for every
    sequence with one index array, and an online softmax keeps, per query and head, the
    running maximum score ``m``, the running sum of ``exp(score - m)`` and the weighted sum
    of V, rescaling both whenever ``m`` grows. Memory per tile is ``S x tile_tokens`` keys,
    whatever the context lengths. Positions past a sequence's context (its padding) are
    masked out.
    """
    num_seqs, n, heads, dim = q.shape
    kv_heads, bs = store.k.shape[2], store.block_size
    group = _gqa_group(heads, kv_heads)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    tables = _pad_tables(block_tables, context_lens, bs)
    # Query heads h*group .. h*group+group-1 read KV head h: fold the group into the query
    # axis instead of copying K and V once per query head.
    qg = (q.reshape(num_seqs, n, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
          .reshape(num_seqs, kv_heads, group * n, dim) / np.sqrt(dim).astype(q.dtype))
    q_pos = context_lens[:, None] - n + np.arange(n)            # [S, n]
    q_pos = np.tile(q_pos, group)[:, None, :, None]              # [S, 1, group*n, 1]
    running_max = np.full((num_seqs, kv_heads, group * n), -np.inf, dtype=q.dtype)
    denom = np.zeros_like(running_max)
    acc = np.zeros((num_seqs, kv_heads, group * n, dim), dtype=q.dtype)
    tile_blocks = max(1, tile_tokens // bs)
    for first in range(0, tables.shape[1], tile_blocks):
        blocks = tables[:, first:first + tile_blocks]           # [S, b]
        length = blocks.shape[1] * bs
        k = store.k[blocks].reshape(num_seqs, length, kv_heads, dim).transpose(0, 2, 3, 1)
        v = store.v[blocks].reshape(num_seqs, length, kv_heads, dim).transpose(0, 2, 1, 3)
        scores = qg @ k                                           # [S, kv_heads, group*n, len]
        key_pos = first * bs + np.arange(length)
        scores = np.where(key_pos <= q_pos, scores, -np.inf)   # causal, and past the context
        # Finite from the first tile on: every query sees position 0.
        new_max = np.maximum(running_max, scores.max(axis=-1))
        rescale = np.exp(running_max - new_max)
        p = np.exp(scores - new_max[..., None])
        denom = denom * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + p @ v
        running_max = new_max
    out = acc / denom[..., None]                                 # [S, kv_heads, group*n, dim]
    return (out.reshape(num_seqs, kv_heads, group, n, dim).transpose(0, 3, 1, 2, 4)
            .reshape(num_seqs, n, heads, dim))


def _pad_tables(block_tables: Sequence[Sequence[int]], context_lens: np.ndarray,
                block_size: int) -> np.ndarray:
    """The block tables as one ``[S, blocks]`` array, wide enough for the longest context;
    short rows are padded with block 0 (any real block: the positions it stands for are
    masked)."""
    tables = np.zeros((len(block_tables), cdiv(int(context_lens.max()), block_size)),
                      dtype=np.int64)
    for row, table, length in zip(tables, block_tables, context_lens, strict=True):
        if length > len(table) * block_size:
            raise ParameterError("block_tables", f"block_tables: positions up to {length} need "
                                                 f"more than {len(table)} blocks")
        row[:len(table)] = table[:len(row)]
    return tables


def _gqa_group(heads: int, kv_heads: int) -> int:
    """Query heads per KV head (grouped-query attention); they must divide evenly."""
    if heads % kv_heads:
        raise ParameterError("q", f"q: query heads ({heads}) must be a multiple of KV heads "
                                  f"({kv_heads})")
    return heads // kv_heads
