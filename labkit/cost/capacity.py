"""How much traffic one replica serves within a latency SLO, from chapter 3's simulator
(:ref:`ch06-throughput-slo`).

A deployment (:class:`~labkit.simulate.deployment.Deployment`) is a model on
``tensor_parallel_size`` GPUs at a weight precision, with vLLM's KV cache and scheduler
defaults, its steps timed by the roofline. Its throughput is not one number: pushed harder,
it serves more tokens per second but each request waits longer. What a deployment can sell
is the highest request rate at which the 99th percentile of time to first token (TTFT) and
of time per output token (TPOT) still meet their targets. :func:`max_rate_at_slo` finds it by
bisection on the request rate, each probe a simulation of the same workload
(:class:`~labkit.simulate.Workload`: same lengths and seed, only the arrival times drawn at
the probe's rate, :meth:`~labkit.simulate.Workload.at_rate`), between a rate where the SLO
holds and the saturation rate (everything sent at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from labkit.checks import ParameterError, in_range
from labkit.hardware import max_concurrency
from labkit.cost.tokens import Throughput, busy_time_s, prefill_only_time_s, prefill_share
from labkit.simulate import BenchmarkResult, SimulationResult, Workload
from labkit.simulate.deployment import Deployment


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
    if not len(workload):
        raise ParameterError("workload", "workload must hold at least one request")
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
    # vLLM's maximum-concurrency rule, for a request of the workload's mean length.
    held = max_concurrency(deployment.usable_blocks, deployment.block_size,
                           math.ceil(workload.mean_prompt_len + workload.mean_output_len))
    concurrency = min(deployment.scheduler_config.max_num_seqs, max(1, int(held)))
    n = max(workload.num_requests, 3 * concurrency)
    longer = Workload(np.zeros(n), np.resize(workload.prompt_lens, n),
                      np.resize(workload.output_lens, n), seed=workload.seed)
    run = deployment.simulate(longer.requests())
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
        result = deployment.simulate(workload.at_rate(rate).requests())
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
