"""Several vLLM instances on one GPU (:ref:`ch06-sharing-two-instances`): what each needs, the
``gpu_memory_utilization`` to give it, and what given fractions do.

Each instance's ``gpu_memory_utilization`` is the fraction of the *whole* GPU it may use, and at
startup vLLM 0.32 refuses to start unless that much is free (``request_memory``,
``vllm/v1/worker/utils.py``; the message is :func:`labkit.engine.device.startup_refusal`). Its
budget holds its weights, the activation peak of its profiling run, its CUDA graphs (profiled
into the budget since vLLM 0.21) and the KV cache, which takes the rest; its CUDA context is
created before the snapshot and sits outside the budget. :func:`plan_sharing` sizes each instance
from the load it must carry; :func:`check_fractions` tells what given fractions do. Older vLLM
counted differently: 0.6.4 documented a *global* limit (issue #10451; PR #10511 restored the
per-instance meaning), and vLLM V1 until PR #18974 (2025) counted the memory of the instances
already running against the next one, so the second fraction had to include the first
(``cumulative_utilization``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.device import MemorySnapshot, format_gib, startup_refusal
from labkit.hardware import (GPU, DoesNotFitError, ModelSpec, activation_bytes, get_gpu,
                             get_model, kv_cache_bytes_per_token, max_concurrency,
                             vllm_batch_defaults, weight_bytes)
from labkit.hardware.dtypes import default_kv_dtype, weight_format
from labkit.units import GiB, MiB, cdiv, ceil_tolerant

#: CUDA graph memory of one instance with CUDA graphs on (vLLM's default): vLLM logged
#: "Graph capturing finished in 14 secs, took 0.21 GiB" for Llama-3.2-1B (vLLM PR #11349,
#: github.com/vllm-project/vllm/pull/11349). One published measurement; it grows with the
#: model and the capture sizes. vLLM 0.32 logs its own estimate at startup ("Estimated CUDA
#: graph memory") and counts it inside the budget.
CUDA_GRAPH_GIB = 0.21

#: A CUDA context, per process, outside every vLLM budget: the first CUDA call of a PyTorch
#: process took 723 MiB (discuss.pytorch.org/t/73021, "the first CUDA call creates the CUDA
#: context"); "~700+MB" depending on the CUDA version (discuss.pytorch.org/t/81330). Measure
#: yours: ``nvidia-smi`` beside a process that has only touched the GPU.
CUDA_CONTEXT_GIB = 723 * MiB / GiB


@dataclass(frozen=True)
class SharedModel:
    """One model to serve on the shared GPU, and the load its KV cache must carry.

    ``concurrency`` sequences of ``max_model_len`` tokens must fit in the KV cache at once
    (the target; vLLM itself only insists on one). ``max_num_seqs`` and
    ``max_num_batched_tokens`` default to vLLM's defaults for the GPU and size the profiling
    run's activation peak. ``enforce_eager`` turns CUDA graphs off, as the flag does.
    """

    name: str
    model: ModelSpec | str
    weight_dtype: str = "bf16"
    kv_dtype: str | None = None
    max_model_len: int = 4096
    concurrency: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    block_size: int = 16

    def __post_init__(self) -> None:
        get_model(self.model)
        weight_format(self.weight_dtype)
        for name in ("max_model_len", "concurrency", "block_size"):
            positive_int(name, getattr(self, name))
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class InstanceMemory:
    """What one vLLM instance needs inside its budget, in bytes
    (:ref:`ch06-sharing-two-instances`)."""

    name: str
    weights_bytes: float
    activations_bytes: float
    cuda_graph_bytes: float
    block_bytes: int
    block_size: int
    max_model_len: int
    concurrency: int

    @property
    def blocks_per_sequence(self) -> int:
        """Whole blocks one sequence of ``max_model_len`` tokens takes."""
        return cdiv(self.max_model_len, self.block_size)

    def max_concurrency(self, num_blocks: int) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request" with
        ``num_blocks`` blocks (:func:`~labkit.hardware.max_concurrency`)."""
        return max_concurrency(num_blocks, self.block_size, self.max_model_len)

    @property
    def kv_blocks_needed(self) -> int:
        return self.concurrency * self.blocks_per_sequence

    @property
    def non_kv_bytes(self) -> float:
        """Everything vLLM takes out of the budget before the KV cache."""
        return self.weights_bytes + self.activations_bytes + self.cuda_graph_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_blocks_needed * self.block_bytes

    def blocks_in(self, kv_cache_bytes: float) -> int:
        """Whole KV blocks in ``kv_cache_bytes`` (none when the budget is negative)."""
        return max(0, int(kv_cache_bytes // self.block_bytes))

    @property
    def budget_bytes(self) -> float:
        return self.non_kv_bytes + self.kv_cache_bytes


def instance_memory(shared: SharedModel, gpu: GPU | str,
                    cuda_graph_gib: float = CUDA_GRAPH_GIB) -> InstanceMemory:
    """The budget one instance needs for its load (:ref:`ch06-sharing-two-instances`), from chapter
    1's formulas: weights (:func:`~labkit.hardware.weight_bytes`), the activation peak
    (:func:`~labkit.hardware.activation_bytes`) and ``concurrency`` sequences of
    ``max_model_len`` tokens of KV cache in whole blocks."""
    gpu, model = get_gpu(gpu), get_model(shared.model)
    in_range("cuda_graph_gib", cuda_graph_gib, 0)
    default_tokens, default_seqs = vllm_batch_defaults(gpu)
    kv_dtype = shared.kv_dtype or default_kv_dtype(shared.weight_dtype)
    block_bytes = shared.block_size * kv_cache_bytes_per_token(model, kv_dtype)
    return InstanceMemory(
        name=shared.name,
        weights_bytes=weight_bytes(model, shared.weight_dtype),
        activations_bytes=activation_bytes(
            model, shared.max_num_batched_tokens or default_tokens,
            shared.max_num_seqs or default_seqs),
        cuda_graph_bytes=0.0 if shared.enforce_eager else cuda_graph_gib * GiB,
        block_bytes=block_bytes, block_size=shared.block_size,
        max_model_len=shared.max_model_len, concurrency=shared.concurrency)


@dataclass(frozen=True)
class InstancePlan:
    """One instance of a :class:`SharingPlan`, in the order it must start.

    ``gpu_memory_utilization`` is the flag to pass to vLLM 0.32 (per instance: its own share
    of the whole GPU); ``cumulative_utilization`` is what the same layout needed where vLLM
    counted the instances already running (0.6.4's global limit; V1 before PR #18974).
    """

    name: str
    memory: InstanceMemory
    gpu_memory_utilization: float
    cumulative_utilization: float
    requested_bytes: int
    free_at_start_bytes: float
    kv_cache_bytes: float

    @property
    def max_model_len(self) -> int:
        return self.memory.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.memory.blocks_in(self.kv_cache_bytes)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"."""
        return self.memory.max_concurrency(self.num_blocks)


@dataclass(frozen=True)
class SharingPlan:
    """Instances on one GPU, each with its ``gpu_memory_utilization``, in start order."""

    gpu: str
    total_bytes: float
    context_bytes: float
    instances: tuple[InstancePlan, ...]

    @property
    def free_after_bytes(self) -> float:
        """What is left once every instance runs (budgets and CUDA contexts taken)."""
        used = sum(i.requested_bytes + self.context_bytes for i in self.instances)
        return self.total_bytes - used

    def commands(self, flags: Mapping[str, str] | None = None) -> list[str]:
        """``vllm serve`` lines in start order; start each once the previous one's
        ``/health`` answers (two instances profiling at once measure each other's memory).
        ``flags`` adds per-model flags (``{"coder": "--quantization awq"}``)."""
        flags = flags or {}
        return [f"vllm serve {i.name} --gpu-memory-utilization {i.gpu_memory_utilization} "
                f"--max-model-len {i.max_model_len}" + (f" {flags[i.name]}" if i.name in flags
                                                        else "")
                for i in self.instances]

    def table(self) -> str:
        """The plan as Markdown: one row per instance, GiB."""
        rows = ["| start | model | weights | activations + graphs | KV cache | budget "
                "| `gpu_memory_utilization` | free at start | 0.6.4, early V1 |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n, i in enumerate(self.instances, 1):
            m = i.memory
            rows.append(f"| {n} | {i.name} | {m.weights_bytes / GiB:.2f} "
                        f"| {(m.activations_bytes + m.cuda_graph_bytes) / GiB:.2f} "
                        f"| {i.kv_cache_bytes / GiB:.2f} | {i.requested_bytes / GiB:.2f} "
                        f"| {i.gpu_memory_utilization:g} | {i.free_at_start_bytes / GiB:.2f} "
                        f"| {i.cumulative_utilization:g} |")
        return "\n".join(rows)


def _round_up(fraction: float, step: float) -> float:
    # Round to the step's decimals after ceil, so 0.43 does not print as 0.43000000000000005.
    decimals = max(0, -math.floor(math.log10(step)))
    return round(ceil_tolerant(fraction / step) * step, decimals)


def plan_sharing(gpu: GPU | str, models: Sequence[SharedModel], *,
                 cuda_context_gib: float = CUDA_CONTEXT_GIB,
                 cuda_graph_gib: float = CUDA_GRAPH_GIB, step: float = 0.01) -> SharingPlan:
    """``gpu_memory_utilization`` for each model so that its KV cache carries its target load,
    and the check vLLM 0.32 makes as they start one after another
    (:ref:`ch06-sharing-two-instances`).

    Each fraction is the instance's budget over the GPU's total, rounded up to ``step``. At
    its start an instance finds free what the ones before it left: the GPU less their budgets
    and CUDA contexts, less its own context. Raises :class:`~labkit.hardware.DoesNotFitError`
    naming the first model that does not fit, what it needs and what is left.
    """
    gpu = get_gpu(gpu)
    if not models:
        raise ParameterError("models", "models must name at least one model")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ParameterError("models", f"models must have distinct names, got {names}")
    in_range("cuda_context_gib", cuda_context_gib, 0)
    in_range("step", step, 0, 0.1, low_open=True)
    total, context = gpu.memory_bytes, cuda_context_gib * GiB
    used, plans = 0.0, []
    for shared in models:
        memory = instance_memory(shared, gpu, cuda_graph_gib)
        utilization = _round_up(memory.budget_bytes / total, step)
        requested = math.ceil(total * utilization)
        free = total - used - context
        if utilization > 1 or free < requested:
            before = ", ".join(f"{p.name} {p.requested_bytes / GiB:.1f} GiB" for p in plans)
            raise DoesNotFitError(
                "models",
                f"{shared.name} does not fit: it needs {memory.budget_bytes / GiB:.1f} GiB "
                f"(weights {memory.weights_bytes / GiB:.1f}, activations and CUDA graphs "
                f"{(memory.activations_bytes + memory.cuda_graph_bytes) / GiB:.1f}, KV cache "
                f"for {shared.concurrency} x {shared.max_model_len} tokens "
                f"{memory.kv_cache_bytes / GiB:.1f}), but the {gpu.name} "
                f"({total / GiB:.0f} GiB) has {max(free, 0) / GiB:.1f} GiB free when it starts"
                + (f" (after {before}, and a {cuda_context_gib:.2f} GiB CUDA context per "
                   f"process)" if plans else f" (less its {cuda_context_gib:.2f} GiB CUDA "
                                             f"context)")
                + ". Lower its concurrency or max_model_len, quantize it, or give it a GPU "
                  "of its own.")
        plans.append(InstancePlan(
            name=shared.name, memory=memory, gpu_memory_utilization=utilization,
            cumulative_utilization=_round_up((used + context + requested) / total, step),
            requested_bytes=requested, free_at_start_bytes=free,
            kv_cache_bytes=requested - memory.non_kv_bytes))
        used += requested + context
    return SharingPlan(gpu.name, total, context, tuple(plans))


@dataclass(frozen=True)
class FractionCheck:
    """What vLLM 0.32 does with one instance's ``gpu_memory_utilization``
    (:ref:`ch06-sharing-two-instances`)."""

    name: str
    gpu_memory_utilization: float
    total_bytes: float
    requested_bytes: int
    free_at_start_bytes: float
    memory: InstanceMemory

    @property
    def max_model_len(self) -> int:
        return self.memory.max_model_len

    @property
    def starts(self) -> bool:
        """Passes the startup check: its fraction of the whole GPU is free."""
        return self.free_at_start_bytes >= self.requested_bytes

    @property
    def serves(self) -> bool:
        """Starts and has KV cache for at least one sequence of ``max_model_len`` tokens;
        otherwise vLLM exits, and holds nothing."""
        return self.starts and self.num_blocks >= self.memory.blocks_per_sequence

    @property
    def kv_cache_bytes(self) -> float:
        return self.requested_bytes - self.memory.non_kv_bytes

    @property
    def num_blocks(self) -> int:
        return self.memory.blocks_in(self.kv_cache_bytes)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"."""
        return self.memory.max_concurrency(self.num_blocks)

    @property
    def verdict(self) -> str:
        """vLLM's own words for what happens, or how much load it carries."""
        if not self.starts:
            snapshot = MemorySnapshot(int(max(self.free_at_start_bytes, 0)),
                                      int(self.total_bytes))
            return startup_refusal("cuda:0", snapshot, self.gpu_memory_utilization,
                                   self.requested_bytes)
        if self.kv_cache_bytes <= 0:
            return ("No available memory for the cache blocks. Try increasing "
                    "`gpu_memory_utilization` when initializing the engine.")
        needed = self.memory.blocks_per_sequence * self.memory.block_bytes
        if self.num_blocks < self.memory.blocks_per_sequence:
            return (f"To serve at least one request with the model's max seq len "
                    f"({self.max_model_len}), ({format_gib(needed)} GiB KV cache is needed, "
                    f"which is larger than the available KV cache memory "
                    f"({format_gib(self.kv_cache_bytes)} GiB).")
        return (f"starts; KV cache {self.kv_cache_bytes / GiB:.1f} GiB holds "
                f"{self.max_concurrency:.1f} sequences of {self.max_model_len} tokens "
                f"(target {self.memory.concurrency})")


def check_fractions(gpu: GPU | str, models: Sequence[SharedModel],
                    utilizations: Sequence[float], *,
                    cuda_context_gib: float = CUDA_CONTEXT_GIB,
                    cuda_graph_gib: float = CUDA_GRAPH_GIB) -> list[FractionCheck]:
    """What vLLM 0.32 does with these fractions when the instances start in this order, one
    after another: who is refused at startup, who starts without room for its KV cache, and
    how many sequences each carries (:ref:`ch06-sharing-two-instances`; used to judge the
    tutorial's 0.95 * 0.45).

    An instance that serves holds its whole budget and its CUDA context; one that vLLM
    refuses, at the startup check or for want of KV cache, exits and holds nothing.
    """
    gpu = get_gpu(gpu)
    if len(models) != len(utilizations):
        raise ParameterError("utilizations", "utilizations: give one per model")
    in_range("cuda_context_gib", cuda_context_gib, 0)
    total, context = gpu.memory_bytes, cuda_context_gib * GiB
    used, checks = 0.0, []
    for shared, utilization in zip(models, utilizations, strict=True):
        in_range("gpu_memory_utilization", utilization, 0, 1, low_open=True)
        check = FractionCheck(
            name=shared.name, gpu_memory_utilization=utilization, total_bytes=total,
            requested_bytes=math.ceil(total * utilization),
            free_at_start_bytes=total - used - context,
            memory=instance_memory(shared, gpu, cuda_graph_gib))
        checks.append(check)
        if check.serves:
            used += check.requested_bytes + context
    return checks

