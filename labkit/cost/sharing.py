"""Sharing one GPU between several models (:doc:`/chapters/ch06_gpu_sharing`): memory plans, MIG,
sleep mode, LoRA.

Four ways to put more than one model on a GPU, each with its arithmetic:

- **Several vLLM instances side by side** (:ref:`ch06-sharing-two-instances`). Each instance's
  ``gpu_memory_utilization`` is the fraction of the *whole* GPU it may use, and at startup vLLM 0.32
  refuses to start unless that much is free (``request_memory``, ``vllm/v1/worker/utils.py``; the
  message is :func:`labkit.engine.device.startup_refusal`). Its budget holds its weights, the
  activation peak of its profiling run, its CUDA graphs (profiled into the budget since vLLM 0.21)
  and the KV cache, which takes the rest; its CUDA context is created before the snapshot and sits
  outside the budget. :func:`plan_sharing` sizes each instance from the load it must carry;
  :func:`check_fractions` tells what given fractions do. Older vLLM counted differently: 0.6.4
  documented a *global* limit (issue #10451; PR #10511 restored the per-instance meaning), and
  vLLM V1 until PR #18974 (2025) counted the memory of the instances already running against
  the next one, so the second fraction had to include the first (``cumulative_utilization``).
- **MIG** (:ref:`ch06-sharing-mig`) cuts an A100, H100 or H200 into isolated instances;
  :func:`pack_mig` says whether a set of profiles fits one GPU, with the placement rules of NVIDIA's
  MIG user guide.
- **vLLM's sleep mode** keeps one model awake at a time: :func:`switch_cost` prices a switch.
- **Multi-LoRA**: one base model, many adapters; :func:`lora_adapter_bytes` and
  :func:`lora_gpu_buffer_bytes` size them.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.device import MemorySnapshot, format_gib, startup_refusal
from labkit.hardware import (GPU, DoesNotFitError, ModelSpec, activation_bytes, get_gpu,
                             get_model, kv_cache_bytes_per_token, vllm_batch_defaults,
                             weight_bytes)
from labkit.hardware.dtypes import default_kv_dtype, weight_format
from labkit.units import GiB, MiB, cdiv

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


# -- several vLLM instances on one GPU --------------------------------------------------------

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
    blocks_per_sequence: int  # a sequence of max_model_len tokens, in whole blocks
    concurrency: int

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
        block_bytes=block_bytes,
        blocks_per_sequence=cdiv(shared.max_model_len, shared.block_size),
        concurrency=shared.concurrency)


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
    max_model_len: int

    @property
    def num_blocks(self) -> int:
        return self.memory.blocks_in(self.kv_cache_bytes)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"."""
        return self.num_blocks / self.memory.blocks_per_sequence


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
    return round(math.ceil(fraction / step - 1e-9) * step, decimals)


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
            kv_cache_bytes=requested - memory.non_kv_bytes, max_model_len=shared.max_model_len))
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
    max_model_len: int

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
        return self.num_blocks / self.memory.blocks_per_sequence

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
            memory=instance_memory(shared, gpu, cuda_graph_gib),
            max_model_len=shared.max_model_len)
        checks.append(check)
        if check.serves:
            used += check.requested_bytes + context
    return checks


# -- MIG --------------------------------------------------------------------------------------

#: Memory slices of every MIG-capable GPU here ("roughly one eighth of the total GPU memory",
#: MIG user guide, Concepts), and the compute (SM) slices ("one seventh").
MIG_MEMORY_SLICES = 8
MIG_COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfile:
    """A GPU instance profile (``labkit/data/mig_profiles.csv``, from NVIDIA's MIG user
    guide): its slices and the memory slices it may start at (``nvidia-smi mig -lgipp``)."""

    gpu: str
    name: str
    profile_id: int
    compute_slices: int
    memory_slices: int
    start_slots: tuple[int, ...]
    max_instances: int
    notes: str
    source: str
    as_of: str

    @property
    def memory_gib(self) -> float:
        """Its share of the GPU's memory; ``nvidia-smi`` reports a little less per instance
        (the guide's A100-40GB example shows 20096 and 20224 MiB for two 3g.20gb)."""
        return get_gpu(self.gpu).memory_gib * self.memory_slices / MIG_MEMORY_SLICES


@lru_cache(maxsize=1)
def _mig_table() -> tuple[MigProfile, ...]:
    text = resources.files("labkit.data").joinpath("mig_profiles.csv").read_text("utf-8")
    return tuple(MigProfile(
        gpu=r["gpu"], name=r["profile"], profile_id=int(r["profile_id"]),
        compute_slices=int(r["compute_slices"]), memory_slices=int(r["memory_slices"]),
        start_slots=tuple(int(s) for s in r["start_slots"].split()),
        max_instances=int(r["max_instances"]), notes=r["notes"], source=r["source"],
        as_of=r["as_of"]) for r in csv.DictReader(text.splitlines()))


def mig_profiles(gpu: GPU | str) -> list[MigProfile]:
    """The MIG profiles of ``gpu``, smallest first; an error for a GPU without MIG here."""
    name = get_gpu(gpu).name
    profiles = [p for p in _mig_table() if p.gpu == name]
    if not profiles:
        have = sorted({p.gpu for p in _mig_table()})
        raise ParameterError("gpu", f"gpu: no MIG profiles for {name}; known: {', '.join(have)}")
    return profiles


def mig_profile(gpu: GPU | str, name: str) -> MigProfile:
    """One profile by its name (``"3g.40gb"``) on ``gpu``."""
    profiles = mig_profiles(gpu)
    for profile in profiles:
        if profile.name == name:
            return profile
    raise ParameterError("profiles", f"profiles: {name!r} is not a MIG profile of "
                                     f"{get_gpu(gpu).name}; its profiles are "
                                     f"{', '.join(p.name for p in profiles)}")


@dataclass(frozen=True)
class MigLayout:
    """Profiles placed on one GPU: ``placements[i]`` is ``(profile, first memory slice)``."""

    gpu: str
    placements: tuple[tuple[MigProfile, int], ...]
    existing: tuple[tuple[MigProfile, int], ...] = ()  # instances that were there already

    def create_command(self) -> str:
        """``nvidia-smi mig -cgi`` for the new instances, largest profile first: nvidia-smi
        chooses each placement itself, and the guide's example shows 3g.20gb failing with
        "Insufficient Resources" when created after 1g, 1g and 2g (profile 9 "must be
        specified first")."""
        new = [p for p in self.placements if p not in self.existing]
        ordered = sorted(new, key=lambda p: (-p[0].memory_slices, p[1]))
        return "nvidia-smi mig -cgi " + ",".join(str(p.profile_id) for p, _ in ordered) + " -C"

    def diagram(self) -> str:
        """The eight memory slices, each labelled with the profile that holds it."""
        cells = ["free"] * MIG_MEMORY_SLICES
        for profile, start in self.placements:
            for s in range(start, start + profile.memory_slices):
                cells[s] = profile.name
        return " | ".join(f"{i}:{c}" for i, c in enumerate(cells))


@dataclass(frozen=True)
class MigFit:
    """The answer of :func:`pack_mig`: a layout, or why there is none."""

    layout: MigLayout | None
    reason: str

    def __bool__(self) -> bool:
        return self.layout is not None


def pack_mig(gpu: GPU | str, names: Sequence[str],
             existing: Sequence[tuple[str, int]] = ()) -> MigFit:
    """Whether these MIG profiles fit one GPU together, and where (:ref:`ch06-sharing-mig`).

    The rules of NVIDIA's MIG user guide: at most 7 compute slices and 8 memory slices;
    each profile at most its "Number of Instances Available"; and each instance starts at one
    of its profile's placements, its memory slices overlapping no other instance's (NVML: a
    new GPU instance "will fail if there is overlap with the already occupied memory
    slices"). ``existing`` lists instances already on the GPU as ``(profile, start slot)``:
    they stay where they are, which is how a GPU fragments as instances come and go.
    Placements are searched exhaustively, largest profile first.
    """
    gpu = get_gpu(gpu)
    if not names:
        raise ParameterError("profiles", "profiles must name at least one MIG profile")
    fixed = [(mig_profile(gpu, n), start) for n, start in existing]
    taken = [False] * MIG_MEMORY_SLICES
    for profile, start in fixed:
        span = range(start, start + profile.memory_slices)
        if start not in profile.start_slots or any(taken[s] for s in span):
            raise ParameterError("existing", f"existing: {profile.name} cannot be at slot "
                                             f"{start} ({_slots(profile)}, not overlapping)")
        for s in span:
            taken[s] = True
    profiles = sorted((mig_profile(gpu, n) for n in names),
                      key=lambda p: (-p.memory_slices, -p.compute_slices, p.name))
    everything = profiles + [p for p, _ in fixed]
    compute = sum(p.compute_slices for p in everything)
    memory = sum(p.memory_slices for p in everything)
    listed = " + ".join([*names, *(f"{p.name} (at {s})" for p, s in fixed)])
    if compute > MIG_COMPUTE_SLICES:
        return MigFit(None, f"{listed} need {compute} compute slices; a {gpu.name} has "
                            f"{MIG_COMPUTE_SLICES}")
    if memory > MIG_MEMORY_SLICES:
        return MigFit(None, f"{listed} need {memory} memory slices; a {gpu.name} has "
                            f"{MIG_MEMORY_SLICES}")
    for profile in dict.fromkeys(everything):
        count = sum(p is profile for p in everything)
        if count > profile.max_instances:
            return MigFit(None, f"{count} x {profile.name}: a {gpu.name} allows at most "
                                f"{profile.max_instances}")
    placement = _place(profiles, taken)
    if placement is None:
        held = [s for s in range(MIG_MEMORY_SLICES) if taken[s]]
        return MigFit(None, f"{listed} fit in slices but not in place: with slots {held} "
                            f"taken, no choice of start slots "
                            f"({'; '.join(_slots(p) for p in dict.fromkeys(profiles))}) keeps "
                            f"them from overlapping")
    layout = MigLayout(gpu.name, tuple(sorted([*zip(profiles, placement, strict=True), *fixed],
                                              key=lambda p: p[1])), tuple(fixed))
    return MigFit(layout, f"fits: {layout.diagram()}")


def _slots(profile: MigProfile) -> str:
    return f"{profile.name} at {{{','.join(map(str, profile.start_slots))}}}"


def _place(profiles: Sequence[MigProfile], taken: list[bool]) -> list[int] | None:
    """Start slots for ``profiles`` on the free memory slices, by backtracking."""
    if not profiles:
        return []
    first, rest = profiles[0], profiles[1:]
    for start in first.start_slots:
        span = range(start, start + first.memory_slices)
        if span.stop > MIG_MEMORY_SLICES or any(taken[s] for s in span):
            continue
        for s in span:
            taken[s] = True
        placed = _place(rest, taken)
        for s in span:
            taken[s] = False
        if placed is not None:
            return [start, *placed]
    return None


def smallest_mig_profile(gpu: GPU | str, needed_gib: float,
                         gpu_memory_utilization: float = 0.9) -> MigProfile | None:
    """The smallest profile (memory, then compute) in which an instance that needs
    ``needed_gib`` of budget fits: vLLM inside a MIG instance takes
    ``gpu_memory_utilization`` of *that instance's* memory. ``None`` when none is big enough."""
    in_range("needed_gib", needed_gib, 0, low_open=True)
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    fitting = [p for p in mig_profiles(gpu) if "+me" not in p.name
               and p.memory_gib * gpu_memory_utilization >= needed_gib]
    return min(fitting, key=lambda p: (p.memory_slices, p.compute_slices), default=None)


# -- time-slicing, MPS, MIG -------------------------------------------------------------------

@dataclass(frozen=True)
class SharingMechanism:
    """How one GPU-sharing mechanism isolates its tenants (``labkit/data/gpu_sharing.csv``)."""

    mechanism: str
    partition_type: str
    max_partitions: str
    compute_isolation: str
    memory_limit: str
    memory_bandwidth_qos: str
    fault_isolation: str
    reconfigure: str
    latency_interference: str
    source: str
    as_of: str


def sharing_mechanisms() -> list[SharingMechanism]:
    """Time-slicing, MPS and MIG compared, each row with its source
    (:ref:`ch06-sharing-timeslicing-mps`)."""
    text = resources.files("labkit.data").joinpath("gpu_sharing.csv").read_text("utf-8")
    return [SharingMechanism(**row) for row in csv.DictReader(text.splitlines())]


# -- sleep mode -------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostLink:
    """The link between host memory and the GPU (``labkit/data/host_links.csv``)."""

    link: str
    gb_s_per_direction: float
    gb_s_both_directions: float
    gpus: str
    source: str
    as_of: str


def host_links() -> dict[str, HostLink]:
    text = resources.files("labkit.data").joinpath("host_links.csv").read_text("utf-8")
    return {r["link"]: HostLink(r["link"], float(r["gb_s_per_direction"]),
                                float(r["gb_s_both_directions"]), r["gpus"], r["source"],
                                r["as_of"]) for r in csv.DictReader(text.splitlines())}


def host_link(name: str) -> HostLink:
    links = host_links()
    if name not in links:
        raise ParameterError("link", f"link must be one of {sorted(links)}, got {name!r}")
    return links[name]


@dataclass(frozen=True)
class SwitchCost:
    """Seconds to put one model to sleep and wake another (chapter 6), at a link's peak:
    lower bounds. The KV cache is discarded at both levels, so the first requests after a
    wake prefill in full (no prefix cache)."""

    level: int
    sleep_s: float
    wake_s: float
    host_memory_bytes: float  # what level 1 keeps in host RAM while asleep

    @property
    def switch_s(self) -> float:
        return self.sleep_s + self.wake_s


def switch_cost(sleeping_weights_bytes: float, waking_weights_bytes: float, level: int,
                link: str = "PCIe Gen5 x16", storage_gb_s: float | None = None) -> SwitchCost:
    """Sleep one model and wake another with vLLM's sleep mode (chapter 6).

    Level 1 copies the sleeping model's weights to host memory and the waking model's back
    (bytes / the link's bandwidth per direction). Level 2 discards the weights: falling asleep
    costs nothing to copy, but waking must reload them (``reload_weights``) from storage at
    ``storage_gb_s``, which you must give (it depends on your disks and page cache).
    """
    in_range("sleeping_weights_bytes", sleeping_weights_bytes, 0)
    in_range("waking_weights_bytes", waking_weights_bytes, 0)
    bandwidth = host_link(link).gb_s_per_direction * 1e9
    if level == 1:
        return SwitchCost(1, sleeping_weights_bytes / bandwidth,
                          waking_weights_bytes / bandwidth, sleeping_weights_bytes)
    if level == 2:
        if storage_gb_s is None:
            raise ParameterError("storage_gb_s", "storage_gb_s: level 2 reloads the weights "
                                                 "from storage; give its read bandwidth in GB/s")
        in_range("storage_gb_s", storage_gb_s, 0, low_open=True)
        return SwitchCost(2, 0.0, waking_weights_bytes / (storage_gb_s * 1e9), 0.0)
    raise ParameterError("level", f"level must be 1 or 2, got {level!r}")


# -- multi-LoRA -------------------------------------------------------------------------------

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


# -- the tutorial's example -------------------------------------------------------------------


def tutorial_models(concurrency: Mapping[str, int] | None = None) -> list[SharedModel]:
    """The tutorial's two models as it deploys them (:ref:`ch06-sharing-two-instances`): Code Llama
    34B and Llama 3 8B, AWQ INT4, ``max_model_len=4096``, ``enforce_eager=True``; ``concurrency``
    sets the target load of each (``{"coder": 8, "chat": 16}``), one sequence by default."""
    concurrency = dict(concurrency or {})
    return [SharedModel("coder", "CodeLlama-34B", weight_dtype="int4-awq", max_model_len=4096,
                        enforce_eager=True, concurrency=concurrency.pop("coder", 1)),
            SharedModel("chat", "Llama-3-8B", weight_dtype="int4-awq", max_model_len=4096,
                        enforce_eager=True, concurrency=concurrency.pop("chat", 1))]


def tutorial_utilizations(gpu_memory_utilization: float = 0.95,
                          memory_fraction: float = 0.45) -> list[float]:
    """What the tutorial passes to each ``LLM``: ``gpu_memory_utilization * memory_fraction``
    (0.95 * 0.45 = 0.4275 for both)."""
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    in_range("memory_fraction", memory_fraction, 0, 1, low_open=True)
    return [gpu_memory_utilization * memory_fraction] * 2
