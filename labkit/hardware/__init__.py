"""GPU selection, memory and rooflines: chapter 1, from :ref:`ch01-three-numbers` to
:ref:`ch01-let-numbers-choose`.

- :mod:`~labkit.hardware.gpus`: the GPU table (``labkit/data/gpus.csv``), each row sourced.
- :mod:`~labkit.hardware.models`: ``ModelSpec`` from a Hugging Face ``config.json``; presets.
- :mod:`~labkit.hardware.memory`: weights, KV cache and activations in bytes and GiB.
- :mod:`~labkit.hardware.kv_budget`: vLLM's view: KV blocks and maximum concurrency.
- :mod:`~labkit.hardware.roofline`: prefill/decode time and tokens/s bounds.
- :mod:`~labkit.hardware.select`: ``select_gpu``, recommendations derived from the above.
"""

from labkit.hardware.dtypes import WEIGHT_FORMATS, WeightFormat, kv_dtype_bytes, weight_format
from labkit.hardware.gpus import GPU, get_gpu, gpu_table_markdown, list_gpus
from labkit.hardware.kv_budget import (DoesNotFitError, KVCachePlan, check_sequence_fits,
                                       max_concurrency, num_kv_blocks, plan_kv_cache,
                                       vllm_batch_defaults)
from labkit.hardware.memory import (MemoryEstimate, activation_bytes, estimate_vram,
                                    kv_cache_bytes_per_token, kv_heads_per_rank, tp_shard,
                                    weight_bytes)
from labkit.hardware.models import ModelSpec, ParamCount, get_model, preset_names, preset_record
from labkit.hardware.roofline import (StepBound, decode_compute_bound_batch, decode_step,
                                      prefill_step, step_bound)
from labkit.hardware.select import Recommendation, select_gpu

__all__ = [
    "GPU", "WEIGHT_FORMATS", "DoesNotFitError", "KVCachePlan", "MemoryEstimate", "ModelSpec",
    "ParamCount", "Recommendation", "StepBound", "WeightFormat", "activation_bytes",
    "check_sequence_fits", "decode_compute_bound_batch", "decode_step", "estimate_vram", "get_gpu",
    "get_model", "gpu_table_markdown", "kv_cache_bytes_per_token", "kv_dtype_bytes",
    "kv_heads_per_rank", "list_gpus", "max_concurrency", "num_kv_blocks", "plan_kv_cache",
    "prefill_step", "preset_names", "preset_record", "select_gpu", "step_bound", "tp_shard",
    "vllm_batch_defaults", "weight_bytes", "weight_format",
]
