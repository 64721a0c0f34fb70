"""select_gpu: every recommendation is derived, minimal and sorted."""

import pytest

from labkit.hardware import DoesNotFitError, get_gpu, plan_kv_cache, select_gpu
from labkit.hardware.select import PRECISIONS


def test_70b_bf16_needs_two_h100s():
    # 70.55e9 params * 2 bytes = 131.4 GiB > 72 GiB (0.9 * 80); half of it fits one GPU.
    best = select_gpu("Llama-3-70B", 8192, gpus=["H100 SXM"], precisions=("bf16",))[0]
    assert best.num_gpus == 2 and best.weight_dtype == "bf16"
    assert best.plan.weights_gib == pytest.approx(65.7, abs=0.1)


def test_8b_fits_one_consumer_card_in_bf16():
    best = select_gpu("Llama-3-8B", 8192, gpus=["RTX 4090"])[0]
    assert (best.num_gpus, best.weight_dtype) == (1, "bf16")
    assert "1 x RTX 4090, bf16 weights" in best.why


def test_options_are_minimal_and_meet_the_concurrency():
    options = select_gpu("Llama-3-70B", 8192, concurrency=32)
    assert options
    for option in options:
        assert option.plan.max_concurrency >= 32
        assert option.headroom >= 1
        smaller = option.num_gpus // 2
        if smaller >= 1:
            try:
                plan = plan_kv_cache("Llama-3-70B", option.gpu, smaller, max_model_len=8192,
                                     weight_dtype=option.weight_dtype)
                assert plan.max_concurrency < 32
            except DoesNotFitError:
                pass


def test_sorted_by_count_then_precision():
    options = select_gpu("Qwen2.5-72B", 16384, concurrency=4)
    keys = [(o.num_gpus, PRECISIONS.index(o.weight_dtype)) for o in options]
    assert keys == sorted(keys)


def test_fp8_only_on_gpus_with_fp8_tensor_cores():
    for option in select_gpu("Llama-3-8B", 4096):
        if option.weight_dtype == "fp8":
            assert get_gpu(option.gpu).has_fp8


def test_pcie_tensor_parallelism_is_flagged():
    option = select_gpu("Llama-3-70B", 8192, gpus=["L40S"], precisions=("bf16",))[0]
    assert option.num_gpus == 4 and option.over_pcie and "over PCIe" in option.why


def test_model_that_fits_nowhere_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        select_gpu("Llama-3.1-405B", 131072, concurrency=64, gpus=["RTX 4090", "L4"])


@pytest.mark.parametrize("kwargs, match", [
    ({"concurrency": 0}, "concurrency must be a positive integer"),
    ({"max_gpus": 0}, "max_gpus must be a positive integer"),
    ({"gpus": ["Z100"]}, "unknown GPU"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_gpu("Llama-3-8B", **kwargs)
