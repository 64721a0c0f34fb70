"""vLLM's view of memory: KV blocks and maximum concurrency."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from labkit.hardware import (
    DoesNotFitError,
    ModelSpec,
    check_sequence_fits,
    num_kv_blocks,
    plan_kv_cache,
    preset_names,
    vllm_batch_defaults,
)
from labkit.units import GiB


def test_llama3_8b_on_h100_by_hand():
    budget = 80 * GiB * 0.9
    weights = 8_030_261_248 * 2
    # vLLM's H100 serving defaults: 8192 batched tokens, 1024 sequences.
    act = 8192 * (2 * 4096 + 6144 + 3 * 14336) * 2 + 1024 * 128256 * 4
    block = 16 * 131072
    blocks = int((budget - weights - act) // block)
    plan = plan_kv_cache("Llama-3-8B", "H100 SXM", max_model_len=8192, overhead_gib=0)
    assert plan.num_gpu_blocks == blocks == 28507
    assert plan.kv_cache_tokens == 28507 * 16
    assert plan.max_concurrency == pytest.approx(28507 / 512)


def test_whole_blocks_of_what_is_left():
    # 100 bytes, 30 of weights, 20 of activations, 5 of overhead: 45 left, 4 blocks of 10.
    assert num_kv_blocks(100, weights_bytes=30, activations_bytes=20, overhead_bytes=5,
                         block_bytes=10) == 4
    assert num_kv_blocks(100, weights_bytes=90, activations_bytes=20, block_bytes=10) == 0
    plan = plan_kv_cache("Llama-3-8B", "H100 SXM", max_model_len=8192)
    assert plan.num_gpu_blocks == num_kv_blocks(
        plan.budget_gib * GiB, weights_bytes=plan.weights_gib * GiB,
        activations_bytes=plan.activations_gib * GiB, overhead_bytes=plan.overhead_gib * GiB,
        block_bytes=plan.block_bytes)


def test_a_sequence_that_can_never_fit():
    check_sequence_fits(32, num_blocks=2, block_size=16, what="x")  # exactly 2 blocks
    with pytest.raises(DoesNotFitError, match="needs 3 blocks of 16 tokens, more than the "
                                              r"cache's 2 blocks \(only 32 tokens fit\)"):
        check_sequence_fits(33, num_blocks=2, block_size=16, what="request 'a'")


def test_batch_defaults_follow_vllm():
    assert vllm_batch_defaults("H100 SXM") == (8192, 1024)
    assert vllm_batch_defaults("H200 SXM", offline=True) == (16384, 1024)
    assert vllm_batch_defaults("A100 80GB") == (2048, 256)   # A100 excluded by name
    assert vllm_batch_defaults("L40S") == (2048, 256)


def test_max_model_len_defaults_to_model_context():
    assert plan_kv_cache("Llama-3-8B", "H100 SXM").max_model_len == 8192


def test_too_big_model_fails_like_vllm():
    with pytest.raises(DoesNotFitError, match="No available memory for the cache blocks"):
        plan_kv_cache("Llama-3-70B", "H100 SXM")
    with pytest.raises(DoesNotFitError, match="max_model_len=131072 needs 8192 blocks") as err:
        plan_kv_cache("Llama-3-8B", "L4", max_model_len=131072)
    assert err.value.param == "max_model_len"


def test_fp8_kv_cache_doubles_blocks():
    bf16 = plan_kv_cache("Llama-3-8B", "L40S", max_model_len=4096, overhead_gib=0)
    fp8 = plan_kv_cache("Llama-3-8B", "L40S", max_model_len=4096, overhead_gib=0, kv_dtype="fp8")
    assert fp8.block_bytes * 2 == bf16.block_bytes
    assert abs(fp8.num_gpu_blocks - 2 * bf16.num_gpu_blocks) <= 1


@pytest.mark.parametrize("kwargs, match", [
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"max_model_len": -5}, "max_model_len must be a positive integer"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_kv_cache("Llama-3-8B", "H100 SXM", **kwargs)


@given(name=st.sampled_from(preset_names()),
       gpu=st.sampled_from(["H200 SXM", "MI300X", "H100 SXM"]),
       tp=st.sampled_from([1, 2, 4, 8]), util=st.floats(0.5, 0.99),
       block=st.sampled_from([1, 8, 16, 32, 128]),
       weights=st.sampled_from(["bf16", "fp8", "int4-awq"]))
def test_blocks_fill_the_budget_without_overflowing(name, gpu, tp, util, block, weights):
    assume(ModelSpec.preset(name).num_attention_heads % tp == 0)
    try:
        plan = plan_kv_cache(name, gpu, tp, util, block, max_model_len=4096, weight_dtype=weights)
    except DoesNotFitError:
        return
    free = (plan.budget_gib - plan.weights_gib - plan.activations_gib - plan.overhead_gib) * GiB
    used = plan.num_gpu_blocks * plan.block_bytes
    assert used <= free < used + plan.block_bytes          # whole blocks, none wasted
    assert plan.kv_cache_tokens >= plan.max_model_len
    more = plan_kv_cache(name, gpu, tp, min(util + 0.01, 1.0), block, max_model_len=4096,
                         weight_dtype=weights)
    assert more.num_gpu_blocks >= plan.num_gpu_blocks
