"""Weights, KV cache and activations: numbers derived by hand from the published shapes."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dataclasses import replace

from labkit.checks import ParameterError
from labkit.hardware import (
    ModelSpec,
    estimate_vram,
    kv_cache_bytes_per_token,
    kv_heads_per_rank,
    preset_names,
    tp_shard,
    weight_bytes,
)
from labkit.units import GiB


@pytest.mark.parametrize("name, expected", [
    # 2 (K, V) * layers * kv_heads * head_dim * 2 bytes
    ("Llama-3-8B", 2 * 32 * 8 * 128 * 2),       # 131,072 = 128 KiB
    ("Llama-3-70B", 2 * 80 * 8 * 128 * 2),      # 327,680 = 320 KiB
    ("Llama-3.1-405B", 2 * 126 * 8 * 128 * 2),  # 516,096 = 504 KiB
    ("Qwen2.5-7B", 2 * 28 * 4 * 128 * 2),       # 57,344 = 56 KiB
    ("Qwen2.5-72B", 2 * 80 * 8 * 128 * 2),      # 327,680 = 320 KiB
    ("Mixtral-8x7B", 2 * 32 * 8 * 128 * 2),     # 131,072 = 128 KiB
])
def test_kv_bytes_per_token_of_presets(name, expected):
    assert kv_cache_bytes_per_token(name, "bf16") == expected
    assert kv_cache_bytes_per_token(name, "fp8_e4m3") == expected // 2


def test_kv_heads_split_then_replicate_under_tensor_parallelism():
    # Llama-3-70B has 8 KV heads: TP=4 holds 2 per GPU; TP=8 and TP=16 hold 1 (replicated).
    assert kv_cache_bytes_per_token("Llama-3-70B", "bf16", 4) == 2 * 80 * 2 * 128 * 2
    assert kv_cache_bytes_per_token("Llama-3-70B", "bf16", 8) == 2 * 80 * 1 * 128 * 2
    assert kv_cache_bytes_per_token("Llama-3-70B", "bf16", 16) == 2 * 80 * 1 * 128 * 2


def test_bf16_weights_are_two_bytes_per_parameter():
    assert weight_bytes("Llama-3-8B", "bf16") == 8_030_261_248 * 2
    assert weight_bytes("Llama-3-8B", "fp32") == 8_030_261_248 * 4


def test_awq_keeps_embeddings_16_bit_and_pays_for_group_scales():
    embed = 128256 * 4096                      # embedding and (untied) LM head each
    norms = 32 * 2 * 4096 + 4096
    linear = 8_030_261_248 - 2 * embed - norms
    bits = 4 + (16 + 4) / 128                  # int4 + fp16 scale + int4 zero per 128 weights
    expected = linear * bits / 8 + (2 * embed + norms) * 2
    assert weight_bytes("Llama-3-8B", "int4-awq") == pytest.approx(expected)
    assert expected / GiB == pytest.approx(5.33, abs=0.01)


def test_tensor_parallel_splits_weights_but_replicates_norms():
    spec = ModelSpec.preset("Llama-3-70B")
    norms = spec.param_counts().norms * 2
    full = weight_bytes(spec, "bf16")
    assert weight_bytes(spec, "bf16", 4) == pytest.approx((full - norms) / 4 + norms)


def test_kv_cache_size_does_not_follow_weight_precision():
    # The tutorial's example: 70B, batch 16, 4096 tokens. Its KV cache is 20 GiB in BF16,
    # whatever the weights are stored in (the tutorial would print 5 GiB for int4).
    by_hand = 2 * 80 * 8 * 128 * 2 * 4096 * 16 / GiB
    assert by_hand == 20.0
    for weights in ("bf16", "fp8", "int4-awq"):
        assert estimate_vram("Llama-3-70B", weights, batch_size=16).kv_cache_gib == by_hand
    fp8_cache = estimate_vram("Llama-3-70B", "int4-awq", kv_dtype="fp8", batch_size=16)
    assert fp8_cache.kv_cache_gib == 10.0


def test_estimate_adds_up_and_fits():
    est = estimate_vram("Llama-3-8B", seq_len=8192, batch_size=4, overhead_gib=0.5)
    assert est.total_gib == pytest.approx(est.weights_gib + est.kv_cache_gib
                                          + est.activations_gib + 0.5)
    assert est.kv_cache_gib == 4.0             # 128 KiB * 8192 * 4 = 4 GiB
    assert est.fits("H100 SXM") and not est.fits("L4")


def test_activation_estimate_by_hand():
    from labkit.hardware import activation_bytes
    # 8192 tokens of Llama-3-8B: (2*4096 + 6144 qkv + 3*14336 mlp) * 2 bytes each,
    # plus FP32 logits for 256 sequences.
    per_token = (2 * 4096 + (4096 + 2 * 1024) + 3 * 14336) * 2
    assert activation_bytes("Llama-3-8B", 8192, 256) == 8192 * per_token + 256 * 128256 * 4


def test_chunked_prefill_caps_activations():
    whole = estimate_vram("Llama-3-70B", batch_size=16)
    chunked = estimate_vram("Llama-3-70B", batch_size=16, max_num_batched_tokens=8192)
    assert chunked.activations_gib < whole.activations_gib / 4


def test_tensor_parallel_splits_evenly_or_refuses():
    assert tp_shard(64, 8, "num_attention_heads") == 8
    # Llama-3-70B's 8 KV heads: split up to 8 ranks, one replicated head per rank beyond.
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    with pytest.raises(ParameterError, match=r"tensor_parallel_size \(3\) must divide x \(64\)"):
        tp_shard(64, 3, "x")
    with pytest.raises(ParameterError, match="tp must be a positive integer"):
        tp_shard(64, 0, "x", param="tp")
    with pytest.raises(ParameterError, match="must divide one another") as err:
        kv_heads_per_rank(8, 12)
    assert err.value.param == "tensor_parallel_size"
    # vLLM also splits the MLP's intermediate size evenly.
    odd = replace(ModelSpec.preset("Llama-3-8B"), intermediate_size=14338)
    with pytest.raises(ValueError, match=r"must divide intermediate_size \(14338\)"):
        kv_cache_bytes_per_token(odd, tensor_parallel_size=4)
    assert kv_cache_bytes_per_token(odd, tensor_parallel_size=2) > 0


@pytest.mark.parametrize("kwargs, match", [
    ({"seq_len": 0}, "seq_len must be a positive integer"),
    ({"batch_size": -2}, "batch_size must be a positive integer"),
    ({"weight_dtype": "int3"}, "weight_dtype must be one of"),
    ({"kv_dtype": "int4"}, "kv_dtype must be one of"),
    ({"tensor_parallel_size": 3}, "must divide num_attention_heads"),
    ({"overhead_gib": -1}, r"overhead_gib must be in \[0, inf\)"),
])
def test_bad_input_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_vram("Llama-3-8B", **kwargs)


@given(name=st.sampled_from(preset_names()), seq=st.integers(1, 131072),
       batch=st.integers(1, 512), tp=st.sampled_from([1, 2, 4, 8]))
def test_kv_cache_is_linear_in_tokens(name, seq, batch, tp):
    assume(ModelSpec.preset(name).num_attention_heads % tp == 0)
    est = estimate_vram(name, seq_len=seq, batch_size=batch, tensor_parallel_size=tp)
    per_token = kv_cache_bytes_per_token(name, "bf16", tp)
    assert est.kv_cache_gib * GiB == per_token * seq * batch
