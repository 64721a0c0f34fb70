"""One replica of a deployment, simulated: a model on ``tensor_parallel_size`` GPUs at a
weight precision, with vLLM's KV cache and scheduler defaults (:ref:`ch06-throughput-slo`,
:ref:`ch05-hpa-kpa-keda`).

:class:`Deployment` is the one record of a replica that chapter 6 prices
(:mod:`labkit.cost.capacity` searches its rate within an SLO) and chapter 5 scales
(:class:`labkit.autoscale.FleetConfig` is a fleet of them). Its KV cache is what vLLM would
allocate (chapter 1's :func:`~labkit.hardware.plan_kv_cache`), its scheduler vLLM's with the
GPU's default batch limits, and its steps are timed by the roofline (chapter 1) plus, with
tensor parallelism, two ring all-reduces per layer over the GPU's link
(:ref:`ch03-tensor-parallelism`), not overlapped with compute. The roofline is an upper bound
on speed: how far below it a real engine lands is measured (``benchmarks/gpu_check.py`` prints
the fraction on a GPU), and the fixed overhead an engine adds per step (``step_overhead_s``)
should come from a measurement too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from labkit.checks import in_range, positive_int
from labkit.hardware import (KVCachePlan, get_gpu, get_model, plan_kv_cache,
                             vllm_batch_defaults, weight_format)
from labkit.hardware.dtypes import default_kv_dtype
from labkit.hardware.memory import check_tensor_parallel
from labkit.kvcache import KVCacheManager
from labkit.parallel import (ALLREDUCES_PER_LAYER, allreduce_bytes, link_gb_s_per_direction,
                             ring_all_reduce_s)
from labkit.scheduling import Request, Scheduler, SchedulerConfig
from labkit.simulate.cost import RooflineCost
from labkit.simulate.records import SimulationResult
from labkit.simulate.simulator import simulate
from labkit.units import cdiv

@dataclass(frozen=True)
class TensorParallelRooflineCost(RooflineCost):
    """The roofline step time plus tensor parallelism's all-reduces (:ref:`ch03-tensor-parallelism`,
    :ref:`ch06-throughput-slo`).

    Each decoder layer all-reduces the step's hidden states twice (after attention and after
    the MLP), a ring over the GPU's link (:func:`labkit.parallel.ring_all_reduce_s`), one
    ``hidden_size`` BF16 row per token of the step. ``allreduce_latency_s`` is the fixed cost
    of each ring step; 0 unless you measured yours. With one GPU it is the plain roofline.
    """

    allreduce_latency_s: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        in_range("allreduce_latency_s", self.allreduce_latency_s, 0)

    def __call__(self, rows) -> float:
        return super().__call__(rows) + self.comm_s(sum(n for n, _ in rows))

    def time_of_totals(self, num_tokens: int, num_pairs: int, num_kv_tokens: int) -> float:
        """The same time from the step's sums, for the fast simulator (see
        :class:`~labkit.simulate.RooflineCost`)."""
        return (super().time_of_totals(num_tokens, num_pairs, num_kv_tokens)
                + self.comm_s(num_tokens))

    def comm_s(self, num_tokens: int) -> float:
        """Seconds of all-reduce in a step of ``num_tokens`` tokens."""
        per_token_s, fixed_s = self._comm_terms
        return per_token_s * num_tokens + fixed_s if num_tokens else 0.0

    @cached_property
    def _comm_terms(self) -> tuple[float, float]:
        """``(seconds per token, fixed seconds)`` of a step's all-reduces: the ring's time
        is linear in the bytes, so two calls give both terms once (the simulator asks for
        every step)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return 0.0, 0.0
        model = get_model(self.model)
        link = link_gb_s_per_direction(self.gpu)
        per_step = model.num_layers * ALLREDUCES_PER_LAYER
        return (per_step * ring_all_reduce_s(allreduce_bytes(model, 1), tp, link),
                per_step * ring_all_reduce_s(0, tp, link, self.allreduce_latency_s))


@dataclass(frozen=True)
class Deployment:
    """One replica: ``model`` on ``tensor_parallel_size`` x ``gpu`` (:ref:`ch06-throughput-slo`;
    chapter 5's fleets are made of them).

    ``max_num_seqs`` and ``max_num_batched_tokens`` default to vLLM's for the GPU
    (:func:`~labkit.hardware.vllm_batch_defaults`), ``kv_dtype`` to vLLM's ``auto``, the KV
    cache to what vLLM allocates at ``max_model_len`` and ``gpu_memory_utilization``.
    """

    model: str
    gpu: str
    tensor_parallel_size: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str | None = None
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    step_overhead_s: float = 0.0
    allreduce_latency_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", get_model(self.model).name)
        object.__setattr__(self, "gpu", get_gpu(self.gpu).name)
        object.__setattr__(self, "weight_dtype", weight_format(self.weight_dtype).name)
        object.__setattr__(self, "kv_dtype", self.kv_dtype or default_kv_dtype(self.weight_dtype))
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        positive_int("max_model_len", self.max_model_len)
        positive_int("block_size", self.block_size)
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        in_range("step_overhead_s", self.step_overhead_s, 0)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size

    @property
    def label(self) -> str:
        return (f"{self.model} {self.weight_dtype} on {self.tensor_parallel_size} x "
                f"{self.gpu}")

    def problem(self) -> str | None:
        """Why this deployment cannot run, or None: a TP size that does not divide the heads
        (:ref:`ch06-comparing`), weights or KV cache that do not fit (:ref:`ch01-what-fits`), a
        precision the GPU has no tensor cores for."""
        try:
            check_tensor_parallel(get_model(self.model), self.tensor_parallel_size)
            self.step_cost(((1, 0),))  # a GPU without FP8 tensor cores raises here
            self.kv_plan  # noqa: B018 -- raises DoesNotFitError
        except ValueError as err:
            return str(err)
        return None

    @cached_property
    def kv_plan(self) -> KVCachePlan:
        """What vLLM would allocate; raises ``DoesNotFitError`` where it would not start."""
        return plan_kv_cache(self.model, self.gpu, self.tensor_parallel_size,
                             self.gpu_memory_utilization, self.block_size, self.max_model_len,
                             self.weight_dtype, self.kv_dtype, self.max_num_batched_tokens,
                             self.max_num_seqs)

    @cached_property
    def step_cost(self) -> TensorParallelRooflineCost:
        return TensorParallelRooflineCost(self.model, self.gpu, self.tensor_parallel_size,
                                          self.weight_dtype, self.kv_dtype,
                                          self.step_overhead_s, self.allreduce_latency_s)

    @cached_property
    def scheduler_config(self) -> SchedulerConfig:
        tokens, seqs = vllm_batch_defaults(self.gpu)
        return SchedulerConfig(self.max_num_seqs or seqs, self.max_num_batched_tokens or tokens)

    def new_scheduler(self) -> Scheduler:
        """A fresh engine: vLLM's scheduler on the planned KV cache (no prefix caching: the
        cost workloads and the autoscaling traces share no prefixes).

        Blocks beyond what ``max_num_seqs`` sequences of ``max_model_len`` tokens can hold are
        never used, so they are left out: the result is the same and a large cache (70B on
        eight GPUs has millions of blocks) is built in a fraction of the time.
        """
        return Scheduler(KVCacheManager(self.usable_blocks, self.block_size,
                                        enable_prefix_caching=False), self.scheduler_config)

    @property
    def usable_blocks(self) -> int:
        """KV blocks the engine can ever use: the plan's, at most what ``max_num_seqs``
        sequences of ``max_model_len`` tokens fill."""
        most = self.scheduler_config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        return min(self.kv_plan.num_gpu_blocks, most)

    def simulate(self, requests: list[Request]) -> SimulationResult:
        """``requests`` through a fresh engine (:func:`~labkit.simulate.simulate`)."""
        return simulate(self.new_scheduler(), requests, self.step_cost)
