"""Checks for the exercises of the chapter 6.2 lab (``labs/06_gpu_sharing.ipynb``).

Expected values come from labkit's own sharing arithmetic (:mod:`labkit.sharing`) and
chapter 1's memory formulas, so the checks agree with what the lab shows. The mistakes they
name: the attention heads where the KV heads belong, a factor 2 (K and V) forgotten, the
weights' 4 bits applied to the cache; the CUDA contexts forgotten, or vLLM's older
cumulative reading of ``gpu_memory_utilization``; a link's bandwidth counted in both
directions; LoRA slots sized at the adapter's rank rather than ``max_lora_rank``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit.checks import in_range, positive_int
from labkit.grading import Feedback, check_number
from labkit.hardware import get_model, kv_cache_bytes_per_token, weight_bytes
from labkit.sharing import (CUDA_CONTEXT_GIB, host_link, lora_adapter_bytes, lora_gpu_buffer_bytes,
                            mig_profile, pack_mig)
from labkit.tutorial.ch06_sharing import tutorial_models
from labkit.units import GiB


def check_kv_bytes_per_token(answer: object, model=None) -> Feedback:
    """Lab 06b, exercise 1: bytes of BF16 KV cache per token of ``model`` (default: the
    tutorial's Code Llama 34B), over all layers."""
    model = get_model(model or tutorial_models()[0].model)
    expected = kv_cache_bytes_per_token(model, "bf16")
    mistakes = {
        "used the attention heads, not the KV heads (grouped-query attention)":
            expected * model.num_attention_heads // model.num_kv_heads,
        "counted K or V but not both": expected / 2,
        "stored the cache in 4 bits like the AWQ weights (the cache stays BF16)": expected / 4,
    }
    return check_number(answer, expected, what="KV bytes per token", unit="bytes", rel_tol=0,
                        mistakes=mistakes)


def largest_second_utilization(total_gib: float, first_utilization: float,
                               context_gib: float = CUDA_CONTEXT_GIB) -> float:
    """The largest ``gpu_memory_utilization`` (two decimals, rounded down) a second vLLM 0.32
    instance can pass once a first one holds ``first_utilization`` of the GPU: its startup
    check wants that fraction of the whole GPU free, and both CUDA contexts sit outside the
    budgets."""
    in_range("total_gib", total_gib, 0, low_open=True)
    in_range("first_utilization", first_utilization, 0, 1, low_open=True)
    free_gib = total_gib - total_gib * first_utilization - 2 * context_gib
    return math.floor(free_gib / total_gib * 100 + 1e-9) / 100


def check_second_utilization(answer: object, total_gib: float = 80.0,
                             first_utilization: float = 0.5,
                             context_gib: float = 0.7) -> Feedback:
    """Lab 06b, exercise 2: the largest fraction a second instance can start with."""
    expected = largest_second_utilization(total_gib, first_utilization, context_gib)
    forgot_contexts = math.floor((1 - first_utilization) * 100 + 1e-9) / 100
    mistakes = {
        "forgot the two CUDA contexts, which sit outside every budget": forgot_contexts,
        "added the first instance's share: that was vLLM's reading before PR #18974, not "
        "0.32's": round(first_utilization + expected, 2),
    }
    return check_number(answer, expected, what="second instance's gpu_memory_utilization",
                        rel_tol=1e-9, mistakes=mistakes)


def check_mig_choice(answer: object, gpu: str = "H100 SXM",
                     needs_gib: Sequence[float] = (34.0, 15.0, 15.0),
                     gpu_memory_utilization: float = 0.9) -> Feedback:
    """Lab 06b, exercise 3: one MIG profile per model (in the order of ``needs_gib``, the
    budget each vLLM instance needs), all on one GPU. Any answer that fits passes."""
    for need in needs_gib:
        in_range("needs_gib", need, 0, low_open=True)
    if answer is None:
        return Feedback(False, "Not answered yet: give a list of profile names, one per model.")
    if (not isinstance(answer, (list, tuple)) or len(answer) != len(needs_gib)
            or not all(isinstance(a, str) for a in answer)):
        return Feedback(False, f"Give a list of {len(needs_gib)} profile names, e.g. "
                               f"['3g.40gb', ...], one per model in order.")
    for name, need in zip(answer, needs_gib, strict=True):
        try:
            profile = mig_profile(gpu, name)
        except ValueError as err:
            return Feedback(False, str(err))
        room = profile.memory_gib * gpu_memory_utilization
        if room < need:
            return Feedback(False, f"Not quite: {name} gives vLLM {room:.1f} GiB "
                                   f"({gpu_memory_utilization:g} of {profile.memory_gib:g} GiB), "
                                   f"less than the {need:g} GiB that model needs.")
    fit = pack_mig(gpu, list(answer))
    if not fit:
        return Feedback(False, f"Each model fits its profile, but together they do not: "
                               f"{fit.reason}.")
    return Feedback(True, f"Correct: {' + '.join(answer)} fit one {gpu} ({fit.reason}); "
                          f"create them with `{fit.layout.create_command()}`.")


def check_wake_seconds(answer: object, model: str = "Llama-3-8B",
                       link: str = "PCIe Gen5 x16") -> Feedback:
    """Lab 06b, exercise 4: seconds to copy ``model``'s BF16 weights back to the GPU when it
    wakes from level-1 sleep, at the link's peak bandwidth in one direction."""
    weights = weight_bytes(model, "bf16")
    per_direction = host_link(link).gb_s_per_direction * 1e9
    expected = weights / per_direction
    return check_number(answer, expected, what="wake time", unit="s", mistakes={
        "used the link's bandwidth in both directions; a copy goes one way": weights
        / (2 * per_direction)})


def check_lora_buffer_gib(answer: object, model: str = "Llama-3-8B", max_loras: int = 8,
                          max_lora_rank: int = 32, adapter_rank: int = 16) -> Feedback:
    """Lab 06b, exercise 5: GiB vLLM reserves for LoRA at startup with ``max_loras`` and
    ``max_lora_rank``, serving adapters of rank ``adapter_rank``."""
    positive_int("adapter_rank", adapter_rank)
    expected = lora_gpu_buffer_bytes(model, max_loras, max_lora_rank) / GiB
    return check_number(answer, expected, what="LoRA buffer", unit="GiB", mistakes={
        "sized the slots at the adapters' rank; vLLM sizes them at max_lora_rank":
            max_loras * lora_adapter_bytes(model, adapter_rank) / GiB,
        "counted one adapter, not max_loras slots":
            lora_adapter_bytes(model, max_lora_rank) / GiB,
    })
