"""vLLM's view of memory: KV blocks and maximum concurrency."""

import json
import subprocess

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from labkit.hardware import (
    DoesNotFitError,
    ModelSpec,
    check_sequence_fits,
    max_concurrency,
    num_kv_blocks,
    plan_kv_cache,
    preset_names,
    vllm_batch_defaults,
)
from labkit.lab import detect
from labkit.units import GiB

VLLM_PYTHON = detect().vllm_cpu_python


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


# vLLM's own capacity rule on a one-group full-attention cache: its function and its log line
# ("GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx",
# update_kv_cache_capacity in vllm/v1/core/kv_cache_utils.py, vLLM 0.32).
_VLLM_CAPACITY = """
import json, logging, sys
from types import SimpleNamespace
import torch
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("vllm").setLevel(logging.INFO)
kv_cache_utils.logger.addHandler(Keep())
values = []
for num_blocks, block_size, max_model_len in json.loads(sys.argv[1]):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                             dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(), device_config=SimpleNamespace(device_type="cuda"),
        attention_config=SimpleNamespace(hisparse_config=None))
    kv_cache_utils.update_kv_cache_capacity(vllm_config, config)
    values.append(vllm_config.cache_config.kv_cache_max_concurrency)
print(json.dumps({"values": values, "lines": lines}))
"""

CASES = [(28507, 16, 8192), (100, 16, 1000), (100, 128, 1000), (7, 16, 17), (0, 16, 16)]


def test_max_concurrency_by_hand():
    # A request of max_model_len tokens takes whole blocks: 1000 tokens are 63 blocks of 16.
    assert max_concurrency(100, 16, 1000) == 100 / 63
    assert max_concurrency(100, 128, 1000) == 12.5       # 8 blocks of 128
    assert max_concurrency(28507, 16, 8192) == 28507 / 512
    assert max_concurrency(0, 16, 16) == 0
    for bad, param in [((-1, 16, 16), "num_blocks"), ((1, 0, 16), "block_size"),
                       ((1, 16, 0), "max_model_len")]:
        with pytest.raises(ValueError) as err:
            max_concurrency(*bad)
        assert err.value.param == param


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM CPU environment (make vllm-env)")
@pytest.mark.real_engine  # vLLM CPU
def test_max_concurrency_is_vllms_rule_and_log_line():
    out = subprocess.run([VLLM_PYTHON, "-c", _VLLM_CAPACITY, json.dumps(CASES)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    vllm = json.loads(out.splitlines()[-1])
    ours = [max_concurrency(*case) for case in CASES]
    assert ours == vllm["values"]
    assert vllm["lines"] == [
        f"GPU KV cache size: {int(x * length):,} tokens, Maximum concurrency for {length:,} "
        f"tokens per request: {x:.2f}x" for x, (_, _, length) in zip(ours, CASES, strict=True)]


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
