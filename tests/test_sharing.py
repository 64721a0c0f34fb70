"""Chapter 6.2's arithmetic, held against hand-derived numbers and NVIDIA's MIG tables.

Every expected number below is derived in a comment from a model's published shape or a
published table, not from labkit's own functions.
"""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.hardware import DoesNotFitError
from labkit.sharing import (SharedModel, check_fractions, instance_memory, lora_adapter_bytes,
                            lora_gpu_buffer_bytes, mig_profile, mig_profiles, pack_mig,
                            plan_sharing, sharing_mechanisms, smallest_mig_profile,
                            switch_cost)
from labkit.tutorial.ch06_sharing import tutorial_models, tutorial_utilizations
from labkit.units import GiB, MiB

# Llama-3-8B (models.json): 32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336,
# vocab 128256. Linear parameters per layer: q and o 4096*4096 each, k and v 4096*1024 each,
# gate/up/down 4096*14336 each.
LLAMA8_LINEAR = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)   # 6,979,321,856
LLAMA8_EMBED_AND_HEAD = 2 * 128256 * 4096                                      # 1,050,673,152
LLAMA8_NORMS = 32 * 2 * 4096 + 4096                                             # 266,240
LLAMA8_BF16_BYTES = 2 * (LLAMA8_LINEAR + LLAMA8_EMBED_AND_HEAD + LLAMA8_NORMS)  # 16,060,522,496
# AWQ: 4 bits plus a 16-bit scale and a 4-bit zero per group of 128 on the linear layers;
# embedding, head and norms stay 16-bit.
LLAMA8_AWQ_BYTES = (LLAMA8_LINEAR * (4 + 20 / 128) / 8
                    + 2 * (LLAMA8_EMBED_AND_HEAD + LLAMA8_NORMS))
# KV per token: 2 (K, V) * 32 layers * 8 heads * 128 * 2 bytes = 131072 B; a 16-token block
# is 2 MiB; 4096 tokens are 256 blocks = 512 MiB.
LLAMA8_KV_TOKEN = 2 * 32 * 8 * 128 * 2
# Activation peak of a 2048-token profiling run with 256 sequences (A100's defaults): per token
# (2 * 4096 + 4096 + 2 * 1024 + 3 * 14336) * 2 bytes, plus FP32 logits for 256 sequences.
LLAMA8_ACT_2048 = 2048 * (2 * 4096 + 4096 + 2 * 1024 + 3 * 14336) * 2 + 256 * 128256 * 4
# Code Llama 34B: 48 layers, hidden 8192, 64 heads, 8 KV heads of 128, MLP 22016, vocab 32000.
CODER_KV_TOKEN = 2 * 48 * 8 * 128 * 2                                           # 192 KiB
CODER_LINEAR = 48 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 22016)
CODER_AWQ_BYTES = CODER_LINEAR * (4 + 20 / 128) / 8 + 2 * (2 * 32000 * 8192 + 48 * 2 * 8192
                                                           + 8192)
A100_80 = 80 * GiB
A100_40 = 40 * GiB
CONTEXT = 723 * MiB


def test_one_instance_budget_from_the_shape():
    chat = SharedModel("chat", "Llama-3-8B", weight_dtype="int4-awq", max_model_len=4096,
                       concurrency=16, enforce_eager=True)
    memory = instance_memory(chat, "A100 80GB")
    assert memory.weights_bytes == pytest.approx(LLAMA8_AWQ_BYTES)
    assert memory.activations_bytes == LLAMA8_ACT_2048
    assert memory.cuda_graph_bytes == 0                                  # enforce_eager
    assert memory.block_bytes == 16 * LLAMA8_KV_TOKEN == 2 * MiB
    assert memory.kv_cache_bytes == 16 * 4096 * LLAMA8_KV_TOKEN == 8 * GiB
    graphs = instance_memory(SharedModel("g", "Llama-3-8B"), "A100 80GB").cuda_graph_bytes
    assert graphs == 0.21 * GiB
    # A 100-token context still takes whole blocks: 7 of 16 tokens.
    short = instance_memory(SharedModel("s", "Llama-3-8B", max_model_len=100), "A100 80GB")
    assert short.kv_cache_bytes == 7 * 2 * MiB


def test_plan_sizes_each_fraction_and_checks_each_start():
    plan = plan_sharing("A100 80GB", tutorial_models({"coder": 8, "chat": 16}))
    coder, chat = plan.instances
    coder_budget = CODER_AWQ_BYTES + coder.memory.activations_bytes + 8 * 4096 * CODER_KV_TOKEN
    chat_budget = LLAMA8_AWQ_BYTES + LLAMA8_ACT_2048 + 8 * GiB
    assert coder.memory.budget_bytes == pytest.approx(coder_budget)
    # Each fraction: its budget over the GPU, rounded up to a hundredth.
    assert coder.gpu_memory_utilization == math.ceil(coder_budget / A100_80 * 100) / 100
    assert chat.gpu_memory_utilization == math.ceil(chat_budget / A100_80 * 100) / 100
    # The first finds the GPU less its own CUDA context free; the second, also the first's
    # budget and context.
    assert coder.free_at_start_bytes == pytest.approx(A100_80 - CONTEXT)
    assert chat.free_at_start_bytes == pytest.approx(A100_80 - coder.requested_bytes
                                                     - 2 * CONTEXT)
    assert chat.requested_bytes == math.ceil(A100_80 * chat.gpu_memory_utilization)
    # Rounded up, each KV cache holds at least its target load.
    assert coder.max_concurrency >= 8 and chat.max_concurrency >= 16
    # Where vLLM counted the instances already running, the second fraction includes them.
    assert chat.cumulative_utilization == math.ceil(
        (coder.requested_bytes + 2 * CONTEXT + chat.requested_bytes) / A100_80 * 100) / 100
    assert plan.commands({"coder": "--quantization awq"}) == [
        f"vllm serve coder --gpu-memory-utilization {coder.gpu_memory_utilization} "
        f"--max-model-len 4096 --quantization awq",
        f"vllm serve chat --gpu-memory-utilization {chat.gpu_memory_utilization} "
        f"--max-model-len 4096"]
    assert plan.free_after_bytes == pytest.approx(
        A100_80 - coder.requested_bytes - chat.requested_bytes - 2 * CONTEXT)


def test_plan_refuses_naming_what_does_not_fit():
    # Coder for 16 sequences: 17.1 + 0.4 + 12 GiB -> 0.74 of 40 GiB; the chat model then finds
    # 40 - 29.6 - 2 * 0.71 = 9.0 GiB for the 14 GiB it needs.
    with pytest.raises(DoesNotFitError, match=r"^chat does not fit") as err:
        plan_sharing("A100 40GB", tutorial_models({"coder": 16, "chat": 16}))
    assert "after coder 29.6 GiB" in str(err.value) and "9.0 GiB free" in str(err.value)
    # Alone too big: Llama 3 70B in BF16 needs more than a whole A100 80GB.
    with pytest.raises(DoesNotFitError, match="Llama-3-70B does not fit.*less its 0.71 GiB"):
        plan_sharing("A100 80GB", [SharedModel("Llama-3-70B", "Llama-3-70B")])
    with pytest.raises(ParameterError, match="distinct"):
        plan_sharing("A100 80GB", [SharedModel("a", "Llama-3-8B")] * 2)


def test_the_tutorials_fractions():
    assert tutorial_utilizations() == [pytest.approx(0.4275)] * 2        # 0.95 * 0.45
    # A100 40GB: 0.4275 * 40 = 17.1 GiB, less than Code Llama 34B's 17.0 GiB of AWQ weights
    # plus its activation peak: vLLM starts it and then finds no room for the cache.
    coder, chat = check_fractions("A100 40GB", tutorial_models(), tutorial_utilizations())
    assert coder.starts and not coder.serves
    assert coder.verdict.startswith("No available memory for the cache blocks")
    assert CODER_AWQ_BYTES / GiB == pytest.approx(17.05, abs=0.01)      # not "~10GB"
    assert LLAMA8_AWQ_BYTES / GiB == pytest.approx(5.33, abs=0.01)
    # The coder exited, so the chat model finds the GPU less its context, and serves.
    assert chat.free_at_start_bytes == pytest.approx(A100_40 - CONTEXT) and chat.serves
    # A100 80GB: both serve; 0.855 of the GPU used, 11.6 GiB left to nobody.
    coder, chat = check_fractions("A100 80GB", tutorial_models(), tutorial_utilizations())
    assert coder.serves and chat.serves
    assert chat.free_at_start_bytes == pytest.approx(A100_80 - coder.requested_bytes
                                                     - 2 * CONTEXT)
    kv = math.ceil(A100_80 * 0.4275) - LLAMA8_AWQ_BYTES - LLAMA8_ACT_2048
    assert chat.num_blocks == int(kv // (2 * MiB))
    assert chat.max_concurrency == chat.num_blocks / 256


def test_a_refused_start_has_vllms_words():
    a, b = check_fractions("A100 80GB", tutorial_models(), [0.5, 0.5])
    assert a.serves and not b.starts
    # 80 - 40 - 2 * 0.71 = 38.59 GiB free, 40 GiB asked.
    assert b.verdict == ("Free memory on device cuda:0 (38.59/80.0 GiB) on startup is less "
                         "than desired GPU memory utilization (0.5, 40.0 GiB). Decrease GPU "
                         "memory utilization or reduce GPU memory used by other processes.")


# -- MIG ---------------------------------------------------------------------------------------

def test_mig_tables_match_the_user_guide():
    # Table 7 (H100 80GB): profile, fraction of SMs (sevenths), of memory (eighths), instances.
    h100 = {p.name: (p.compute_slices, p.memory_slices, p.max_instances)
            for p in mig_profiles("H100 SXM")}
    assert h100 == {"1g.10gb": (1, 1, 7), "1g.10gb+me": (1, 1, 1), "1g.20gb": (1, 2, 4),
                    "2g.20gb": (2, 2, 3), "3g.40gb": (3, 4, 2), "4g.40gb": (4, 4, 1),
                    "7g.80gb": (7, 8, 1)}
    # nvidia-smi mig -lgipp (getting-started-with-mig.html): profile ID: start slots.
    slots = {p.profile_id: p.start_slots for p in mig_profiles("A100 40GB")}
    assert slots == {19: (0, 1, 2, 3, 4, 5, 6), 20: (0, 1, 2, 3, 4, 5, 6), 15: (0, 2, 4, 6),
                     14: (0, 2, 4), 9: (0, 4), 5: (0,), 0: (0,)}
    assert [p.name for p in mig_profiles("H200 SXM")][-1] == "7g.141gb"   # Table 8
    # Table 9 (B200, Blackwell): the same shapes over 180 GB, and nvidia-smi's profile IDs.
    b200 = {p.name: (p.profile_id, p.compute_slices, p.memory_slices, p.max_instances)
            for p in mig_profiles("B200")}
    assert b200 == {"1g.23gb": (19, 1, 1, 7), "1g.23gb+me": (20, 1, 1, 1),
                    "1g.45gb": (15, 1, 2, 4), "2g.45gb": (14, 2, 2, 3),
                    "3g.90gb": (9, 3, 4, 2), "4g.90gb": (5, 4, 4, 1), "7g.180gb": (0, 7, 8, 1)}
    assert mig_profile("B200", "3g.90gb").memory_gib == 90
    assert mig_profile("A100 40GB", "3g.20gb").memory_gib == 20
    assert mig_profile("H200 SXM", "1g.18gb").memory_gib == pytest.approx(141 / 8)
    with pytest.raises(ParameterError, match="no MIG profiles for L4"):
        mig_profiles("L4")
    with pytest.raises(ParameterError, match="3g.20gb"):
        pack_mig("H100 SXM", ["3g.20gb"])


# Geometries that fit an A100 40GB: the list a MIG scheduler ships (nebuly-ai/nos,
# pkg/gpu/mig/known_configs.go), written before driver R510, so without 4g + 3g.
KNOWN_A100_40GB = [
    ["7g.40gb"], ["4g.20gb", "2g.10gb", "1g.5gb"], ["4g.20gb"] + ["1g.5gb"] * 3,
    ["3g.20gb"] * 2, ["3g.20gb", "2g.10gb", "1g.5gb"], ["3g.20gb"] + ["1g.5gb"] * 3,
    ["2g.10gb"] * 2 + ["3g.20gb"], ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"],
    ["2g.10gb"] * 3 + ["1g.5gb"], ["2g.10gb"] * 2 + ["1g.5gb"] * 3,
    ["2g.10gb"] + ["1g.5gb"] * 5, ["1g.5gb"] * 7]


@pytest.mark.parametrize("names", KNOWN_A100_40GB)
def test_known_layouts_fit(names):
    fit = pack_mig("A100 40GB", names)
    assert fit, fit.reason
    assert sorted(p.name for p, _ in fit.layout.placements) == sorted(names)


def test_mig_layouts_that_fit_and_do_not():
    # "prior to NVIDIA driver release R510, the combination of a (4 memory, 4 compute) and a
    # (4 memory, 3 compute) profile was not supported. This restriction no longer applies."
    fit = pack_mig("A100 40GB", ["4g.20gb", "3g.20gb"])
    assert [(p.name, s) for p, s in fit.layout.placements] == [("4g.20gb", 0), ("3g.20gb", 4)]
    # The guide's two 3g.20gb instances sit at 0:4 and 4:4 (nvidia-smi mig -lgi).
    assert [s for _, s in pack_mig("A100 40GB", ["3g.20gb"] * 2).layout.placements] == [0, 4]
    # The guide's 3-2-1-1 geometry, created largest first (profile 9 "must be specified first").
    fit = pack_mig("A100 40GB", ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"])
    assert fit.layout.create_command() == "nvidia-smi mig -cgi 9,14,19,19 -C"
    assert not pack_mig("H100 SXM", ["4g.40gb", "2g.20gb", "2g.20gb"])   # 8 compute slices
    assert "compute slices" in pack_mig("H100 SXM", ["7g.80gb", "1g.10gb"]).reason
    assert "9 memory slices" in pack_mig("H100 SXM", ["1g.20gb"] * 4 + ["1g.10gb"]).reason
    assert "at most 1" in pack_mig("H100 SXM", ["1g.10gb+me"] * 2).reason
    # Fragmentation: with 2g.10gb at slot 0 and 1g.5gb at slot 4, 3g.20gb (slots 0 or 4)
    # has nowhere to go, though 4 compute and 5 memory slices are free.
    stuck = pack_mig("A100 40GB", ["3g.20gb"], existing=[("2g.10gb", 0), ("1g.5gb", 4)])
    assert not stuck and "not in place" in stuck.reason
    moved = pack_mig("A100 40GB", ["3g.20gb"], existing=[("2g.10gb", 0), ("1g.5gb", 2)])
    assert moved and moved.layout.create_command() == "nvidia-smi mig -cgi 9 -C"
    with pytest.raises(ParameterError, match="cannot be at slot 1"):
        pack_mig("A100 40GB", ["1g.5gb"], existing=[("2g.10gb", 1)])


def brute_force_fits(gpu, names):
    """A reference: try every combination of start slots, no pruning, no ordering."""
    profiles = [mig_profile(gpu, n) for n in names]
    if sum(p.compute_slices for p in profiles) > 7:
        return False
    if any(names.count(p.name) > p.max_instances for p in profiles):
        return False
    for starts in itertools.product(*(p.start_slots for p in profiles)):
        cells = [s + i for p, s in zip(profiles, starts, strict=True)
                 for i in range(p.memory_slices)]
        if max(cells) < 8 and len(cells) == len(set(cells)):
            return True
    return False


@settings(max_examples=150, deadline=None)
@given(gpu=st.sampled_from(["A100 40GB", "H100 SXM", "H200 SXM"]),
       picks=st.lists(st.integers(0, 6), min_size=1, max_size=7))
def test_packer_agrees_with_brute_force(gpu, picks):
    names = [mig_profiles(gpu)[i].name for i in picks]
    fit = pack_mig(gpu, names)
    assert bool(fit) == brute_force_fits(gpu, names), fit.reason
    if fit:
        cells = [s + i for p, s in fit.layout.placements for i in range(p.memory_slices)]
        assert len(cells) == len(set(cells)) and max(cells) < 8
        assert all(s in p.start_slots for p, s in fit.layout.placements)


def test_smallest_profile_for_a_model():
    # vLLM takes 90 % of the instance's memory: 30 GiB needs 3g.40gb (36), 15 GiB needs a
    # 20 GB profile, and 1g.20gb (one compute slice) is smaller than 2g.20gb.
    assert smallest_mig_profile("H100 SXM", 30).name == "3g.40gb"
    assert smallest_mig_profile("H100 SXM", 15).name == "1g.20gb"
    assert smallest_mig_profile("H100 SXM", 80) is None                  # 0.9 * 80 = 72
    assert smallest_mig_profile("H200 SXM", 60).name == "3g.71gb"        # 0.9 * 70.5


def test_sharing_mechanisms_are_sourced():
    rows = {m.mechanism: m for m in sharing_mechanisms()}
    assert set(rows) == {"time-slicing", "MPS", "MIG"}
    assert rows["MPS"].max_partitions == "48" and rows["MIG"].max_partitions == "7"
    assert rows["MIG"].fault_isolation == "yes" and rows["MPS"].memory_bandwidth_qos == "no"
    assert all(m.source.startswith("https://") and m.as_of for m in rows.values())


# -- sleep mode and LoRA ---------------------------------------------------------------------------

def test_switch_cost():
    # Llama 3 8B in BF16 is 16,060,522,496 bytes; PCIe Gen4 x16 moves 32 GB/s each way.
    cost = switch_cost(LLAMA8_BF16_BYTES, LLAMA8_BF16_BYTES, level=1, link="PCIe Gen4 x16")
    assert cost.sleep_s == cost.wake_s == pytest.approx(16.060522496 / 32)
    assert cost.host_memory_bytes == LLAMA8_BF16_BYTES
    assert switch_cost(LLAMA8_BF16_BYTES, 0, 1, "NVLink-C2C").sleep_s == pytest.approx(
        16.060522496 / 450)
    # Level 2: nothing to copy out; the waking model reloads from storage at 2 GB/s.
    cost = switch_cost(LLAMA8_BF16_BYTES, LLAMA8_BF16_BYTES, level=2, storage_gb_s=2.0)
    assert cost.sleep_s == 0 and cost.wake_s == pytest.approx(16.060522496 / 2)
    assert cost.switch_s == cost.wake_s
    with pytest.raises(ParameterError, match="storage_gb_s"):
        switch_cost(1, 1, level=2)
    with pytest.raises(ParameterError, match="link"):
        switch_cost(1, 1, level=1, link="PCIe Gen9")


def test_lora_sizes():
    # Rank 16 on all seven projections of Llama 3 8B: per layer 16 * ((4096 + 4096) * 2
    # + (4096 + 1024) * 2 + (4096 + 14336) * 3) = 1,310,720; * 32 layers = 41,943,040
    # parameters, 2 bytes each.
    assert lora_adapter_bytes("Llama-3-8B", 16) == 41_943_040 * 2
    assert lora_adapter_bytes("Llama-3-8B", 8, ["q_proj", "v_proj"]) == \
        8 * ((4096 + 4096) + (4096 + 1024)) * 32 * 2
    # vLLM reserves max_loras slots at max_lora_rank: 4 * (64 / 16) * 80 MiB = 1.25 GiB.
    assert lora_gpu_buffer_bytes("Llama-3-8B", 4, 64) == 4 * 4 * 41_943_040 * 2 == 1.25 * GiB
    with pytest.raises(ParameterError, match="max_lora_rank"):
        lora_gpu_buffer_bytes("Llama-3-8B", 4, 48)
    with pytest.raises(ParameterError, match="target_modules"):
        lora_adapter_bytes("Llama-3-8B", 16, ["qkv"])
    with pytest.raises(ParameterError, match="mixture of experts"):
        lora_adapter_bytes("Mixtral-8x7B", 16)
