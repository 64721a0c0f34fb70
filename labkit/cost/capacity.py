"""How much traffic one replica serves within a latency SLO, from chapter 3's simulator
(:ref:`ch06-throughput-slo`).

A deployment is a model on ``tensor_parallel_size`` GPUs at a weight precision, with vLLM's
KV cache (chapter 1's :func:`~labkit.hardware.plan_kv_cache`) and scheduler defaults. Its
throughput is not one number: pushed harder, it serves more tokens per second but each
request waits longer. What a deployment can sell is the highest request rate at which the
99th percentile of time to first token (TTFT) and of time per output token (TPOT) still meet
their targets. :func:`max_rate_at_slo` finds it by bisection on the request rate, each probe a
simulation of the same workload (same lengths and seed: only the arrival times are scaled),
between a rate where the SLO holds and the saturation rate (everything sent at once).

Steps are timed by the roofline (chapter 1), plus, with tensor parallelism, two ring
all-reduces per layer over the GPU's link (:ref:`ch03-tensor-parallelism`), not overlapped with
compute. The roofline is an upper bound on speed: real engines reach 50-80 % of it, and add a fixed
overhead per step (``step_overhead_s``) that a measurement should supply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from labkit.checks import ParameterError, in_range, positive_int
from labkit.hardware import (KVCachePlan, get_gpu, get_model, plan_kv_cache,
                             vllm_batch_defaults, weight_format)
from labkit.hardware.dtypes import default_kv_dtype
from labkit.hardware.memory import check_tensor_parallel
from labkit.kvcache import KVCacheManager
from labkit.parallel import (ALLREDUCES_PER_LAYER, allreduce_bytes, link_gb_s_per_direction,
                             ring_all_reduce_s)
from labkit.scheduling import Request, Scheduler, SchedulerConfig
from labkit.simulate import (BenchmarkResult, RooflineCost, SimulationResult, random_workload,
                             sample_lengths, simulate)
from labkit.cost.tokens import Throughput, busy_time_s, prefill_only_time_s, prefill_share
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
    """One replica: ``model`` on ``tensor_parallel_size`` x ``gpu`` (:ref:`ch06-throughput-slo`).

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
        cost workloads share no prefixes).

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
        return simulate(self.new_scheduler(), requests, self.step_cost)


@dataclass(frozen=True)
class Workload:
    """The requests a throughput is measured on (:ref:`ch06-throughput-slo`): their lengths, how
    many, how bursty their arrivals (gamma shape, 1 = Poisson) and the seed. Build one with
    :meth:`fixed` or :meth:`lognormal`."""

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    burstiness: float = 1.0
    seed: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_lens or len(self.prompt_lens) != len(self.output_lens):
            raise ParameterError("prompt_lens", "prompt_lens and output_lens need one entry "
                                                "per request, at least one")
        if min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ParameterError("prompt_lens", "every prompt and output needs >= 1 token")
        in_range("burstiness", self.burstiness, 0, low_open=True)

    @classmethod
    def fixed(cls, prompt_len: int, output_len: int, num_requests: int = 200, *,
              burstiness: float = 1.0, seed: int = 0) -> Workload:
        """Every request ``prompt_len`` tokens in, ``output_len`` out (``vllm bench serve``'s
        random dataset with ``--random-range-ratio 0``)."""
        positive_int("num_requests", num_requests)
        positive_int("prompt_len", prompt_len)
        positive_int("output_len", output_len)
        return cls((prompt_len,) * num_requests, (output_len,) * num_requests, burstiness,
                   seed, f"{num_requests} requests of {prompt_len} in / {output_len} out")

    @classmethod
    def lognormal(cls, median_prompt_len: int, median_output_len: int,
                  num_requests: int = 200, *, max_prompt_len: int, max_output_len: int,
                  sigma: float = 1.0, burstiness: float = 1.0, seed: int = 0) -> Workload:
        """Long-tailed lengths like chat traffic (:func:`labkit.simulate.sample_lengths`),
        clipped at the maxima."""
        positive_int("num_requests", num_requests)
        prompts = sample_lengths("lognormal", num_requests, seed, mean=median_prompt_len,
                                 high=max_prompt_len, sigma=sigma)
        outputs = sample_lengths("lognormal", num_requests, seed + 1, mean=median_output_len,
                                 high=max_output_len, sigma=sigma)
        return cls(tuple(int(p) for p in prompts), tuple(int(o) for o in outputs), burstiness,
                   seed, f"{num_requests} requests, lognormal lengths, median "
                         f"{median_prompt_len} in / {median_output_len} out")

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean(self.prompt_lens))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean(self.output_lens))

    @property
    def longest(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens, strict=True))

    def requests(self, request_rate: float) -> list[Request]:
        """The requests arriving at ``request_rate`` per second (``inf``: all at t = 0)."""
        return random_workload(self.num_requests, request_rate, self.prompt_lens,
                               self.output_lens, self.burstiness, self.seed)


@dataclass(frozen=True)
class LatencySLO:
    """Targets for the 99th percentiles of TTFT and TPOT, in milliseconds
    (:ref:`ch06-throughput-slo`)."""

    p99_ttft_ms: float
    p99_tpot_ms: float

    def __post_init__(self) -> None:
        in_range("p99_ttft_ms", self.p99_ttft_ms, 0, low_open=True)
        in_range("p99_tpot_ms", self.p99_tpot_ms, 0, low_open=True)

    def met_by(self, summary: BenchmarkResult) -> bool:
        return (summary.p99_ttft_ms <= self.p99_ttft_ms
                and summary.p99_tpot_ms <= self.p99_tpot_ms)

    def __str__(self) -> str:
        return f"p99 TTFT <= {self.p99_ttft_ms:g} ms, p99 TPOT <= {self.p99_tpot_ms:g} ms"


@dataclass(frozen=True)
class RateProbe:
    """One simulation of the search: the offered rate and its p99 latencies."""

    request_rate: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    meets_slo: bool


@dataclass(frozen=True)
class SLOCapacity:
    """The most a deployment serves within an SLO (:ref:`ch06-throughput-slo`), and how it
    was found.

    ``max_request_rate`` is 0 when even a nearly idle replica misses the SLO.
    ``prefill_share`` is measured at that rate (see :mod:`labkit.cost.tokens`).
    """

    deployment: Deployment
    slo: LatencySLO
    workload: Workload
    max_request_rate: float
    saturation_request_rate: float
    summary: BenchmarkResult | None
    prefill_share: float
    probes: tuple[RateProbe, ...]

    @property
    def feasible(self) -> bool:
        return self.max_request_rate > 0

    @property
    def input_tok_s(self) -> float:
        return self.max_request_rate * self.workload.mean_prompt_len

    @property
    def output_tok_s(self) -> float:
        return self.max_request_rate * self.workload.mean_output_len

    @property
    def provenance(self) -> str:
        d = self.deployment
        model = "roofline" + (" + ring all-reduce" if d.tensor_parallel_size > 1 else "")
        if d.step_overhead_s:
            model += f" + {1e3 * d.step_overhead_s:g} ms per step"
        found = (f"met up to {self.max_request_rate:.2f} req/s" if self.feasible
                 else "missed even at the lowest rate tried")
        return (f"simulated: {d.label}, {model}, {self.workload.description}; {self.slo} "
                f"{found} ({_simulations(len(self.probes))}, saturation "
                f"{self.saturation_request_rate:.2f} req/s)")

    def throughput(self) -> Throughput:
        """The throughput to price (:func:`labkit.cost.tokens.token_cost`); raises when the
        SLO cannot be met at all."""
        if not self.feasible:
            raise ParameterError("slo", f"{self.deployment.label} cannot meet {self.slo} at "
                                        f"any load: no throughput to price")
        return Throughput(self.input_tok_s, self.output_tok_s, self.max_request_rate,
                          self.prefill_share, self.deployment.num_gpus, self.provenance)


def _simulations(n: int) -> str:
    return "1 simulation" if n == 1 else f"bisection over {n} simulations"


def max_rate_at_slo(deployment: Deployment, slo: LatencySLO, workload: Workload,
                    rel_tol: float = 0.05) -> SLOCapacity:
    """The highest request rate at which ``deployment`` meets ``slo`` on ``workload``, found
    by bisection to within ``rel_tol`` of the bracket (:ref:`ch06-throughput-slo`).

    The search starts at the saturation rate (:func:`saturation_request_rate`): above it no
    SLO holds for long, however loose, and a short run would hide that. If the SLO holds
    there, the deployment is bound by throughput, not latency, and that is the answer; else
    it halves the interval below it until the bracket is narrower than ``rel_tol`` of its top.
    If no rate down to 10 % of saturation meets the SLO, the deployment cannot meet it at all
    (a prompt alone takes too long to prefill, or one decode step is too slow): the rate is 0.
    Results are cached: the same arguments return the same object.
    """
    in_range("rel_tol", rel_tol, 0, 1, low_open=True, high_open=True)
    problem = deployment.problem()
    if problem is not None:
        raise ParameterError("deployment", f"{deployment.label} cannot run: {problem}")
    if workload.longest > deployment.max_model_len:
        raise ParameterError("workload", f"a request of {workload.longest} tokens exceeds "
                                         f"max_model_len={deployment.max_model_len}")
    return _search(deployment, slo, workload, rel_tol)


def saturation_request_rate(deployment: Deployment, workload: Workload) -> float:
    """The request rate a replica sustains when requests never stop coming
    (:ref:`ch06-throughput-slo`).

    Every request of a longer copy of ``workload`` (its lengths repeated, at least three times
    as many requests as the KV cache holds at once) arrives at t = 0; the rate is the number
    of requests over the time to finish them all. The ramp at the start and the drain at the
    end count in that time, so this is slightly below the steady state: a rate no load above
    it can be sustained at, since the queue would grow without bound, whatever a short run
    shows.
    """
    blocks_each = cdiv(math.ceil(workload.mean_prompt_len + workload.mean_output_len),
                       deployment.block_size)
    concurrency = min(deployment.scheduler_config.max_num_seqs,
                      max(1, deployment.usable_blocks // blocks_each))
    n = max(workload.num_requests, 3 * concurrency)
    repeat = cdiv(n, workload.num_requests)
    longer = Workload((workload.prompt_lens * repeat)[:n], (workload.output_lens * repeat)[:n],
                      workload.burstiness, workload.seed)
    run = deployment.simulate(longer.requests(math.inf))
    return n / run.duration_s


#: The load, as a share of saturation, below which the search stops looking for a rate that
#: meets the SLO. Lower loads change little (a replica that misses the SLO at 10 % load misses
#: it nearly idle too) and simulate slowly: every request decodes alone.
_LOWEST_LOAD = 0.1


@lru_cache(maxsize=256)
def _search(deployment: Deployment, slo: LatencySLO, workload: Workload,
            rel_tol: float) -> SLOCapacity:
    probes: list[RateProbe] = []

    def probe(rate: float) -> tuple[bool, SimulationResult, BenchmarkResult]:
        result = deployment.simulate(workload.requests(rate))
        summary = result.summary()
        ok = slo.met_by(summary)
        probes.append(RateProbe(rate, summary.p99_ttft_ms, summary.p99_tpot_ms, ok))
        return ok, result, summary

    saturation = saturation_request_rate(deployment, workload)
    lo, hi = 0.0, saturation
    best_run = best = None
    ok, run, summary = probe(hi)
    if ok:  # bound by throughput, not by latency
        lo, best_run, best = hi, run, summary
    while best is None or hi - lo > rel_tol * hi:
        if best is None and hi <= _LOWEST_LOAD * saturation:
            return SLOCapacity(deployment, slo, workload, 0.0, saturation, None, 0.0,
                               tuple(probes))
        mid = (lo + hi) / 2
        ok, run, summary = probe(mid)
        if ok:
            lo, best_run, best = mid, run, summary
        else:
            hi = mid
    prefill_s = prefill_only_time_s(workload.prompt_lens, deployment.step_cost,
                                    deployment.scheduler_config.max_num_batched_tokens)
    share = prefill_share(prefill_s, busy_time_s(best_run))
    return SLOCapacity(deployment, slo, workload, lo, saturation, best, share, tuple(probes))
