"""Tensor parallelism: every split equals the single-device result; ring costs by hand."""

import numpy as np
import pytest

from labkit.parallel import (all_gather, allreduce_bytes, allreduce_bytes_per_layer, attention,
                             column_parallel_linear, link_gb_s_per_direction, megatron_mlp, mlp,
                             ring_all_reduce_bytes, ring_all_reduce_s, row_parallel_linear,
                             split_rows, tensor_parallel_attention, tp_decode_scaling)

rng = np.random.default_rng(0)
X = rng.normal(size=(6, 32))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_column_then_gather_and_row_then_reduce(tp):
    w, b = rng.normal(size=(32, 16)), rng.normal(size=16)
    cols = all_gather(column_parallel_linear(X, w, b, tp))
    rows = row_parallel_linear(np.split(X, tp, axis=1), w, b, tp)
    for out in cols + rows:
        np.testing.assert_allclose(out, X @ w + b, atol=1e-10)


def test_bias_added_on_every_rank_is_counted_tp_times():
    w, b = rng.normal(size=(32, 16)), rng.normal(size=16)
    naive = sum(xr @ wr + b for xr, wr in zip(np.split(X, 4, axis=1), split_rows(w, 4),
                                                strict=True))
    np.testing.assert_allclose(naive - (X @ w + b), 3 * np.broadcast_to(b, naive.shape))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_megatron_mlp_equals_single_device(tp):
    wg, wu, wd = rng.normal(size=(32, 64)), rng.normal(size=(32, 64)), rng.normal(size=(64, 32))
    for out in megatron_mlp(X, wg, wu, wd, tp):
        np.testing.assert_allclose(out, mlp(X, wg, wu, wd), atol=1e-9)


@pytest.mark.parametrize("tp, kv_heads", [(1, 2), (2, 2), (4, 2), (8, 2), (4, 8)])
def test_attention_split_by_heads_equals_single_device(tp, kv_heads):
    heads, dim = 8, 4
    wq, wo = rng.normal(size=(32, heads * dim)), rng.normal(size=(heads * dim, 32))
    wk, wv = rng.normal(size=(32, kv_heads * dim)), rng.normal(size=(32, kv_heads * dim))
    expected = attention(X, wq, wk, wv, wo, heads, kv_heads)
    for out in tensor_parallel_attention(X, wq, wk, wv, wo, heads, kv_heads, tp):
        np.testing.assert_allclose(out, expected, atol=1e-9)


def test_ring_all_reduce_by_hand():
    # 8 ranks, 16 MB each over 450 GB/s: 2*7 steps of 2 MB = 28 MB at 450 GB/s = 62.2 us.
    assert ring_all_reduce_s(16e6, 8, 450) == pytest.approx(28e6 / 450e9)
    assert ring_all_reduce_s(16e6, 1, 450) == 0.0
    assert ring_all_reduce_s(0, 4, 450, latency_s=5e-6) == pytest.approx(6 * 5e-6)
    assert link_gb_s_per_direction("H100 SXM") == 450


def test_ring_all_reduce_traffic_per_rank():
    # 2 (p-1) / p of the buffer: nothing alone, the whole buffer on 2 ranks, near twice on many.
    assert [ring_all_reduce_bytes(16e6, p) for p in (1, 2, 4, 8)] == [0, 16e6, 24e6, 28e6]
    assert ring_all_reduce_s(16e6, 8, 450) == pytest.approx(ring_all_reduce_bytes(16e6, 8)
                                                           / 450e9)


def test_communication_volume_and_scaling():
    # Llama-3-70B: 2 all-reduces of 8192 BF16 values per token per layer.
    assert allreduce_bytes("Llama-3-70B", 1) == 8192 * 2
    assert allreduce_bytes_per_layer("Llama-3-70B", 1) == 2 * 8192 * 2
    steps = tp_decode_scaling("Llama-3-70B", "H100 SXM", [1, 2, 4, 8], batch_size=32,
                              context_len=2048, latency_s=10e-6)
    assert steps[0].comm_s == 0
    assert [s.compute_s for s in steps] == pytest.approx([steps[0].compute_s / t
                                                          for t in (1, 2, 4, 8)])
    assert steps[3].comm_s > steps[1].comm_s  # more ranks, more latency-bound steps
    pcie = tp_decode_scaling("Llama-3-70B", "L40S", [4], 32, 2048)[0]
    nvlink = tp_decode_scaling("Llama-3-70B", "H100 SXM", [4], 32, 2048)[0]
    assert pcie.comm_s / nvlink.comm_s == pytest.approx(900 / 64)


@pytest.mark.parametrize("call, match", [
    (lambda: column_parallel_linear(X, np.zeros((32, 10)), None, 4),
     r"tp \(4\) must divide the output width \(10\)"),
    (lambda: split_rows(np.zeros((32, 10)), 0), "tp must be a positive integer"),
    (lambda: tensor_parallel_attention(X, np.zeros((32, 24)), np.zeros((32, 9)),
                                       np.zeros((32, 9)), np.zeros((24, 32)), 8, 3, 4),
     "must divide one another"),
    (lambda: ring_all_reduce_s(1, 2, 0), r"link_gb_s must be in \(0, inf\)"),
    (lambda: ring_all_reduce_bytes(-1, 2), "num_bytes must be in"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
