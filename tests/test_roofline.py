"""Roofline bounds, checked against numbers derived by hand."""

import math

import pytest

from labkit.hardware import (
    ModelSpec,
    decode_compute_bound_batch,
    decode_step,
    get_gpu,
    prefill_step,
)

H100_BW = 3.35e12        # bytes/s
H100_BF16 = 989e12       # FLOP/s


def test_llama3_8b_single_stream_decode_on_h100():
    # Bytes: every weight except the embedding table, of which only the looked-up row
    # (4096 values) is read, plus one token of KV cache (128 KiB).
    weights = 8_030_261_248 * 2 - 128256 * 4096 * 2 + 4096 * 2
    step = decode_step("Llama-3-8B", "H100 SXM", batch_size=1, context_len=1)
    assert step.bytes_moved == weights + 131072
    assert step.bound == "memory"
    assert step.time_s == pytest.approx((weights + 131072) / H100_BW)
    assert step.tokens_per_s == pytest.approx(223.2, abs=0.1)  # 4.48 ms per token


def test_decode_flops_count_linear_layers_and_attention():
    spec = ModelSpec.preset("Llama-3-8B")
    c = spec.param_counts()
    linear = 2 * (c.total - c.embedding - c.norms)          # LM head included, lookup not
    attention = 4 * 32 * 4096 * 1000                        # QK^T and AV over 1000 tokens
    assert decode_step(spec, "H100 SXM", 1, 1000).flops == linear + attention


def test_crossover_batch_matches_closed_form_for_short_context():
    # Dense model, context 1: compute = (2N + 4*L*q) * B, bytes = W + B*(row + kv).
    # Compute-bound once B >= ridge*W / (2N + 4*L*q - ridge*(row + kv)).
    spec = ModelSpec.preset("Llama-3-8B")
    c = spec.param_counts()
    n2 = 2 * (c.total - c.embedding - c.norms) + 4 * 32 * 4096
    fixed = (c.total - c.embedding) * 2
    per_seq = 4096 * 2 + 131072
    ridge = H100_BF16 / H100_BW
    expected = math.ceil(ridge * fixed / (n2 - ridge * per_seq))
    assert decode_compute_bound_batch(spec, "H100 SXM", context_len=1) == expected
    assert 290 < expected < 310      # ~ the ridge point, 295 FLOP/byte


def test_long_context_decode_never_turns_compute_bound():
    # Each sequence brings 128 KiB of KV per token of context: at 4096 tokens its
    # intensity tops out far below the ridge.
    assert decode_compute_bound_batch("Llama-3-8B", "H100 SXM", context_len=4096) is None


def test_prefill_is_compute_bound_and_decode_is_not():
    prefill = prefill_step("Llama-3-70B", "H100 SXM", prompt_len=2048)
    assert prefill.bound == "compute"
    assert prefill.compute_s == pytest.approx(prefill.flops / H100_BF16)
    assert decode_step("Llama-3-70B", "H100 SXM", 8, 2048).bound == "memory"


def test_causal_prefill_attention_pairs():
    spec = ModelSpec.preset("Qwen2.5-7B")
    c = spec.param_counts()
    linear = 2 * (c.total - c.embedding - c.norms)
    expected = linear * 100 + 4 * 28 * 3584 * (100 * 101 / 2)
    assert prefill_step(spec, "L4", prompt_len=100).flops == pytest.approx(expected)


def test_moe_decode_reads_only_routed_experts():
    spec = ModelSpec.preset("Mixtral-8x7B")
    one = decode_step(spec, "H100 SXM", 1, 1)
    many = decode_step(spec, "H100 SXM", 4096, 1)
    c = spec.param_counts()
    # Batch 1: two experts per layer; a large batch touches all eight.
    assert one.bytes_moved == pytest.approx((c.active - c.embedding) * 2, rel=1e-3)
    weights_many = many.bytes_moved - 4096 * spec.kv_size * 2 * 32 * 2
    assert weights_many == pytest.approx((c.total - c.embedding) * 2, rel=1e-3)


def test_quantized_weights_speed_up_memory_bound_decode():
    bf16 = decode_step("Llama-3-70B", "H100 SXM", 1, 1, weight_dtype="bf16")
    int4 = decode_step("Llama-3-70B", "H100 SXM", 1, 1, weight_dtype="int4-awq")
    assert 3.0 < int4.tokens_per_s / bf16.tokens_per_s < 4.0   # 16 -> 4.16 bits, 16-bit head


def test_tensor_parallel_divides_per_gpu_work():
    one = decode_step("Llama-3-70B", "H100 SXM", 16, 1024)
    four = decode_step("Llama-3-70B", "H100 SXM", 16, 1024, tensor_parallel_size=4)
    assert four.time_s == pytest.approx(one.time_s / 4)


def test_throughput_grows_with_batch_until_the_roof():
    rates = [decode_step("Llama-3-8B", "L40S", b, 512).tokens_per_s for b in (1, 8, 64)]
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.parametrize("call, match", [
    (lambda: decode_step("Llama-3-8B", "H100 SXM", 0, 10), "batch_size must be a positive"),
    (lambda: prefill_step("Llama-3-8B", "H100 SXM", -1), "prompt_len must be a positive"),
    (lambda: decode_step("Llama-3-8B", "A100 80GB", 1, 1, weight_dtype="fp8"), "no fp8 tensor"),
    (lambda: decode_step("Llama-3-8B", "H100 SXM", 1, 1, weight_dtype="fp32"), "fp32 has none"),
    (lambda: decode_step("Llama-3-8B", "Z100", 1, 1), "unknown GPU"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ridge_matches_table():
    assert get_gpu("H100 SXM").ridge_point() == pytest.approx(H100_BF16 / H100_BW)
