"""Multi-LoRA (chapter 6, :doc:`/chapters/ch06_gpu_sharing`): one base model and many adapters,
and the memory they take.

:func:`lora_adapter_bytes` sizes one adapter (``rank x (d_in + d_out)`` per target module);
:func:`lora_gpu_buffer_bytes` the slots vLLM sets aside at startup for ``max_loras`` adapters of
``max_lora_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.checks import ParameterError, positive_int
from labkit.hardware import ModelSpec, get_model

#: The linear layers vLLM wraps with LoRA in a Llama-family decoder layer.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``max_lora_rank`` values vLLM 0.32 accepts (``MaxLoRARanks``, ``vllm/config/lora.py``).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_module_shapes(model: ModelSpec | str) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of each LoRA target module in one decoder layer of a dense model."""
    model = get_model(model)
    if model.is_moe:
        raise ParameterError("model", f"model: {model.name} is a mixture of experts; LoRA "
                                      f"sizes here cover dense models")
    h, i = model.hidden_size, model.intermediate_size
    return {"q_proj": (h, model.q_size), "k_proj": (h, model.kv_size),
            "v_proj": (h, model.kv_size), "o_proj": (model.q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_adapter_bytes(model: ModelSpec | str, rank: int,
                       target_modules: Sequence[str] = LORA_MODULES,
                       dtype_bytes: int = 2) -> int:
    """Bytes of one LoRA adapter: ``rank x (d_in + d_out)`` per target module (its A and B
    matrices), over every layer, at ``dtype_bytes`` per weight (chapter 6)."""
    positive_int("rank", rank)
    positive_int("dtype_bytes", dtype_bytes)
    shapes = lora_module_shapes(model)
    unknown = [m for m in target_modules if m not in shapes]
    if unknown or not target_modules:
        raise ParameterError("target_modules", f"target_modules must be among "
                                               f"{', '.join(shapes)}, got {list(target_modules)}")
    per_layer = sum(rank * (shapes[m][0] + shapes[m][1]) for m in target_modules)
    return per_layer * get_model(model).num_layers * dtype_bytes


def lora_gpu_buffer_bytes(model: ModelSpec | str, max_loras: int, max_lora_rank: int,
                          target_modules: Sequence[str] = LORA_MODULES,
                          dtype_bytes: int = 2) -> int:
    """GPU memory vLLM sets aside for adapters at startup (chapter 6): ``max_loras`` slots,
    each of ``max_lora_rank`` whatever an adapter's own rank (``create_lora_weights`` in
    ``vllm/lora/layers/base_linear.py``, vLLM 0.32, allocates ``lora_a_stacked`` and
    ``lora_b_stacked`` of that shape). Adapters beyond ``max_loras`` wait in host memory
    (``max_cpu_loras``)."""
    positive_int("max_loras", max_loras)
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        raise ParameterError("max_lora_rank", f"max_lora_rank must be one of "
                                              f"{VLLM_MAX_LORA_RANKS}, got {max_lora_rank!r}")
    return max_loras * lora_adapter_bytes(model, max_lora_rank, target_modules, dtype_bytes)

