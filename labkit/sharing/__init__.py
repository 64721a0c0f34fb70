"""Sharing one GPU between several models (:doc:`/chapters/ch06_gpu_sharing`), one module per way:

- :mod:`~labkit.sharing.instances`: several vLLM instances side by side, each with its
  ``gpu_memory_utilization`` (:ref:`ch06-sharing-two-instances`): :func:`plan_sharing` sizes
  them from their load, :func:`check_fractions` says what given fractions do;
- :mod:`~labkit.sharing.mig`: MIG profiles and their placement on one GPU
  (:ref:`ch06-sharing-mig`), beside time-slicing and MPS (:ref:`ch06-sharing-timeslicing-mps`);
- :mod:`~labkit.sharing.sleep`: vLLM's sleep mode, one model awake at a time, and the cost of a
  switch;
- :mod:`~labkit.sharing.lora`: one base model and many LoRA adapters, and their memory.

The tutorial's own two-instance example is :mod:`labkit.tutorial.ch06_sharing`.
"""

from labkit.sharing.instances import (CUDA_CONTEXT_GIB, CUDA_GRAPH_GIB, FractionCheck,
                                      InstanceMemory, InstancePlan, SharedModel, SharingPlan,
                                      check_fractions, instance_memory, plan_sharing)
from labkit.sharing.lora import (LORA_MODULES, VLLM_MAX_LORA_RANKS, lora_adapter_bytes,
                                 lora_gpu_buffer_bytes, lora_module_shapes)
from labkit.sharing.mig import (MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES, MigFit, MigLayout,
                                MigProfile, SharingMechanism, mig_gpus, mig_profile, mig_profiles,
                                pack_mig, sharing_mechanisms, smallest_mig_profile)
from labkit.sharing.sleep import HostLink, SwitchCost, host_link, host_links, switch_cost

__all__ = [
    "CUDA_CONTEXT_GIB", "CUDA_GRAPH_GIB", "LORA_MODULES", "MIG_COMPUTE_SLICES",
    "MIG_MEMORY_SLICES", "VLLM_MAX_LORA_RANKS", "FractionCheck", "HostLink", "InstanceMemory",
    "InstancePlan", "MigFit", "MigLayout", "MigProfile", "SharedModel", "SharingMechanism",
    "SharingPlan", "SwitchCost", "check_fractions", "host_link", "host_links", "instance_memory",
    "lora_adapter_bytes", "lora_gpu_buffer_bytes", "lora_module_shapes", "mig_gpus",
    "mig_profile", "mig_profiles", "pack_mig", "plan_sharing", "sharing_mechanisms",
    "smallest_mig_profile", "switch_cost",
]
