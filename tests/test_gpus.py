"""The GPU table: complete, sourced, dated, and internally consistent."""

import datetime as dt

import pytest

from labkit.hardware import get_gpu, gpu_table_markdown, list_gpus

REQUIRED = ["B200", "H200 SXM", "H100 SXM", "H100 PCIe", "A100 80GB", "A100 40GB", "L40S", "L4",
            "A10G", "RTX 4090", "RTX 3090", "MI300X"]


def test_required_parts_are_in_the_table():
    names = [g.name for g in list_gpus()]
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("gpu", list_gpus(), ids=lambda g: g.name)
def test_every_row_is_sourced_dated_and_positive(gpu):
    assert gpu.source.startswith("https://")
    dt.date.fromisoformat(gpu.as_of)
    for value in (gpu.memory_gib, gpu.mem_bandwidth_gb_s, gpu.bf16_tflops,
                  gpu.interconnect_gb_s, gpu.tdp_w):
        assert value > 0
    # Where a part has both, 8-bit tensor paths run at twice the 16-bit rate, or more.
    for eight_bit in (gpu.fp8_tflops, gpu.int8_tops):
        if eight_bit is not None:
            assert eight_bit >= 1.99 * gpu.bf16_tflops


def test_ampere_has_no_fp8():
    assert not get_gpu("A100 80GB").has_fp8 and get_gpu("H100 SXM").has_fp8
    with pytest.raises(ValueError, match="no fp8 tensor cores"):
        get_gpu("A100 80GB").peak_ops_s("fp8")


def test_ridge_point_by_hand():
    # 989 TFLOP/s / 3.35 TB/s = 295.2 FLOP per byte
    assert get_gpu("H100 SXM").ridge_point() == pytest.approx(989 / 3.35)


def test_lookup_ignores_case_and_spacing():
    assert get_gpu("h100sxm").name == "H100 SXM"
    assert get_gpu("rtx-4090").name == "RTX 4090"
    with pytest.raises(ValueError, match="unknown GPU 'B9000'"):
        get_gpu("B9000")
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        get_gpu("L4").peak_ops_s("int2")


def test_markdown_table_has_a_row_per_gpu():
    lines = gpu_table_markdown().splitlines()
    assert len(lines) == 2 + len(list_gpus())
    assert any(line.startswith("| A100 80GB |") and "| — |" in line for line in lines)


# GeForce datasheets headline the FP16 tensor rate with FP16 accumulation; chapter 1.1 states
# that BF16 with FP32 accumulation, the mode inference uses, runs at half of it, and INT8 at
# twice it. Headline dense rates (TFLOP/s) from NVIDIA's GA102 whitepaper v2, appendix A
# (RTX 3090: 142) and the Ada architecture whitepaper, table 2 (RTX 4090: 330.3).
GEFORCE_FP16_ACC16_TFLOPS = {"RTX 3090": 142.0, "RTX 4090": 330.3}


@pytest.mark.parametrize("name", sorted(GEFORCE_FP16_ACC16_TFLOPS))
def test_geforce_rates_follow_the_chapters_rule(name):
    gpu, headline = get_gpu(name), GEFORCE_FP16_ACC16_TFLOPS[name]
    assert gpu.bf16_tflops == pytest.approx(headline / 2, rel=0.005)
    assert gpu.int8_tops == pytest.approx(headline * 2, rel=0.005)


def test_every_geforce_row_is_checked_by_the_rule():
    geforce = {g.name for g in list_gpus() if g.name.startswith("RTX")}
    assert geforce == set(GEFORCE_FP16_ACC16_TFLOPS)
