"""Paged attention equals dense attention on the same data, GQA included."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.attention import (
    PagedKVStore,
    batched_paged_attention,
    dense_attention,
    paged_attention,
)


@settings(max_examples=40, deadline=None)
@given(context=st.integers(1, 70), block_size=st.sampled_from([1, 4, 16]),
       groups=st.sampled_from([1, 2, 4]), kv_heads=st.sampled_from([1, 2]),
       queries=st.integers(1, 8), tile=st.integers(1, 80), seed=st.integers(0, 1000))
def test_paged_equals_dense(context, block_size, groups, kv_heads, queries, tile, seed):
    """Small tiles make the online softmax combine many of them."""
    queries = min(queries, context)
    rng = np.random.default_rng(seed)
    dim = 8
    k = rng.normal(size=(context, kv_heads, dim))
    v = rng.normal(size=(context, kv_heads, dim))
    q = rng.normal(size=(queries, kv_heads * groups, dim))
    num_blocks = -(-context // block_size)
    table = rng.permutation(num_blocks + 5)[:num_blocks].tolist()   # scattered blocks
    store = PagedKVStore(num_blocks + 5, block_size, kv_heads, dim, dtype=np.float64)
    split = int(rng.integers(0, context + 1))                        # written in two pieces
    store.write(table, 0, k[:split], v[:split])
    store.write(table, split, k[split:], v[split:])
    expected = dense_attention(q, k, v)
    np.testing.assert_allclose(paged_attention(q, store, table, context, tile), expected,
                               atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(contexts=st.lists(st.integers(1, 60), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 4, 16]), groups=st.sampled_from([1, 4]),
       queries=st.integers(1, 4), tile=st.integers(1, 64), seed=st.integers(0, 1000))
def test_batched_equals_dense_per_sequence(contexts, block_size, groups, queries, tile, seed):
    """Sequences of different lengths in one call: the padding of the short ones is masked,
    and each sequence sees only its own blocks, scattered over one shared pool."""
    queries = min(queries, *contexts)
    rng = np.random.default_rng(seed)
    kv_heads, dim = 2, 8
    need = [-(-c // block_size) for c in contexts]
    pool = rng.permutation(sum(need) + 3)
    store = PagedKVStore(len(pool), block_size, kv_heads, dim, dtype=np.float64)
    tables = np.split(pool[:sum(need)], np.cumsum(need)[:-1])
    kvs = [(rng.normal(size=(c, kv_heads, dim)), rng.normal(size=(c, kv_heads, dim)))
           for c in contexts]
    for table, (k, v) in zip(tables, kvs, strict=True):
        store.write(table.tolist(), 0, k, v)
    q = rng.normal(size=(len(contexts), queries, kv_heads * groups, dim))
    got = batched_paged_attention(q, store, [t.tolist() for t in tables], contexts, tile)
    for s, (k, v) in enumerate(kvs):
        np.testing.assert_allclose(got[s], dense_attention(q[s], k, v), atol=1e-6)


def test_dense_attention_by_hand():
    # One query attending to two keys with scores 0 and log(3)*sqrt(1): weights 1/4, 3/4.
    q = np.array([[[1.0]]])
    k = np.array([[[0.0]], [[np.log(3)]]])
    v = np.array([[[4.0]], [[8.0]]])
    assert dense_attention(q, k, v)[0, 0, 0] == pytest.approx(0.25 * 4 + 0.75 * 8)


def test_errors():
    store = PagedKVStore(2, 4, 1, 2)
    with pytest.raises(ValueError, match="more than 2 blocks"):
        store.write([0, 1], 6, np.zeros((3, 1, 2)), np.zeros((3, 1, 2)))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(np.zeros((1, 3, 2)), PagedKVStore(2, 4, 2, 2), [0], 1)
    with pytest.raises(ValueError, match="more than 1 blocks"):
        paged_attention(np.zeros((1, 2, 2)), PagedKVStore(2, 4, 2, 2), [0], 5)
