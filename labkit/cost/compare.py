"""Which deployment serves a traffic profile for the least money
(:ref:`ch06-month-of-traffic`, :ref:`ch06-comparing`).

For every GPU x weight precision x tensor-parallel size: does it run at all (chapter 1's
memory math, vLLM's divisibility rules, the GPU's tensor cores), how many requests per second
one replica serves within the latency SLO (:func:`~labkit.cost.capacity.max_rate_at_slo`),
what a token costs at full use, and what a month of the traffic costs:

- **a fixed fleet** sized for the peak: ``ceil(peak rate / rate per replica)`` replicas, every
  one paid every hour of the month. Its utilization is the mean load over the fleet's
  capacity, and the month's bill over the month's tokens is the price a token really costs;
- **an autoscaled fleet** (chapter 5): :func:`autoscaled_fleet_cost` runs
  :func:`labkit.autoscale.simulate_autoscaling` on a trace and bills the replica-hours it
  held, cold starts included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from labkit.autoscale import (COLD_START_S, RUNNING, AutoscaleResult, FleetConfig,
                              HorizontalPodAutoscaler, Policy, simulate_autoscaling)
from labkit.checks import ParameterError, in_range, positive_int
from labkit.cost.capacity import LatencySLO, SLOCapacity, max_rate_at_slo
from labkit.simulate import Workload
from labkit.cost.prices import HOURS_PER_MONTH, GPUPrice, gpu_hourly_price
from labkit.cost.tokens import TokenCost, token_cost
from labkit.simulate.deployment import Deployment
from labkit.units import ceil_tolerant


@dataclass(frozen=True)
class TrafficProfile:
    """What a month of traffic looks like (:ref:`ch06-month-of-traffic`): the mean request rate,
    which sets the tokens sold, and the peak, which sets the replicas a fixed fleet needs."""

    mean_request_rate: float
    peak_request_rate: float

    def __post_init__(self) -> None:
        in_range("mean_request_rate", self.mean_request_rate, 0, low_open=True)
        in_range("peak_request_rate", self.peak_request_rate, self.mean_request_rate)

    @classmethod
    def diurnal(cls, trough_request_rate: float, peak_request_rate: float) -> TrafficProfile:
        """A daily cycle from trough to peak and back along a raised cosine, the shape of
        :func:`labkit.autoscale.diurnal_trace`: its mean is halfway between the two."""
        in_range("trough_request_rate", trough_request_rate, 0, peak_request_rate)
        return cls((trough_request_rate + peak_request_rate) / 2, peak_request_rate)

    @property
    def monthly_requests(self) -> float:
        return self.mean_request_rate * 3600 * HOURS_PER_MONTH


def replicas_needed(peak_rate: float, rate_per_replica: float) -> int:
    """Replicas to serve ``peak_rate`` when each serves at most ``rate_per_replica`` within
    the SLO, both in the same unit (requests/s here, output tokens/s in chapter 7's
    :class:`~labkit.cost.tco.Scenario`): the ratio rounded up, at least one
    (:ref:`ch06-month-of-traffic`). A replica is a whole tensor-parallel group; one cannot add a
    single GPU to it."""
    in_range("peak_rate", peak_rate, 0)
    if not rate_per_replica > 0:
        raise ParameterError("rate_per_replica",
                             f"rate_per_replica must be > 0 (a replica that meets the SLO at "
                             f"no load cannot serve any), got {rate_per_replica!r}")
    # Round away the last bits of float division (0.3 / 0.1 must be 3, not 4).
    return max(1, ceil_tolerant(peak_rate / rate_per_replica))


def monthly_cost_usd(replicas: float, gpus_per_replica: int, usd_per_gpu_hour: float) -> float:
    """Dollars a month for ``replicas`` replicas of ``gpus_per_replica`` GPUs
    (:ref:`ch06-month-of-traffic`): every GPU bills every hour of an average month
    (:data:`~labkit.cost.prices.HOURS_PER_MONTH`), busy or idle; there is no utilization factor
    here. ``replicas`` may be a mean over the month: an autoscaled fleet's replica-hours over
    the hours."""
    in_range("replicas", replicas, 0)
    positive_int("gpus_per_replica", gpus_per_replica)
    in_range("usd_per_gpu_hour", usd_per_gpu_hour, 0)
    return replicas * gpus_per_replica * usd_per_gpu_hour * HOURS_PER_MONTH


@dataclass(frozen=True)
class FleetCost:
    """A month of a traffic profile on a fleet (:ref:`ch06-month-of-traffic`).

    ``utilization`` is the mean load over the fleet's capacity at the SLO; ``usd_per_1m_tokens``
    the month's bill over the month's tokens (input and output together), idle hours included.
    """

    replicas: int
    gpus_per_replica: int
    usd_per_gpu_hour: float
    monthly_usd: float
    utilization: float
    usd_per_1m_tokens: float


def fixed_fleet_cost(capacity: SLOCapacity, traffic: TrafficProfile,
                     price: GPUPrice | float) -> FleetCost:
    """A fleet sized for the peak, paid every hour (:ref:`ch06-month-of-traffic`)."""
    usd = price.usd_per_gpu_hour if isinstance(price, GPUPrice) else price
    per_replica = capacity.max_request_rate
    replicas = replicas_needed(traffic.peak_request_rate, per_replica)
    gpus = capacity.deployment.num_gpus
    monthly = monthly_cost_usd(replicas, gpus, usd)
    tokens = traffic.monthly_requests * (capacity.workload.mean_prompt_len
                                         + capacity.workload.mean_output_len)
    return FleetCost(replicas, gpus, usd, monthly,
                     traffic.mean_request_rate / (replicas * per_replica),
                     monthly / tokens * 1e6)


@dataclass(frozen=True)
class DeploymentOption:
    """One row of a comparison (:ref:`ch06-comparing`). ``problem`` says why a deployment is out
    (does not fit, no price, misses the SLO at any load); the other fields are then None."""

    deployment: Deployment
    problem: str | None
    capacity: SLOCapacity | None = None
    price: GPUPrice | None = None
    cost: TokenCost | None = None
    fleet: FleetCost | None = None


def compare_deployments(model: str, slo: LatencySLO, workload: Workload,
                        traffic: TrafficProfile, *, gpus: Iterable[str],
                        weight_dtypes: Iterable[str] = ("bf16",),
                        tensor_parallel_sizes: Iterable[int] = (1, 2, 4, 8),
                        prices: Sequence[GPUPrice] | None = None,
                        **deployment_options) -> list[DeploymentOption]:
    """Every GPU x precision x TP size for ``model``, cheapest month first (:ref:`ch06-comparing`).

    Each runnable deployment is priced with :func:`~labkit.cost.prices.gpu_hourly_price`: the
    median on-demand offer for its number of GPUs, from ``prices`` (your own quotes, or the
    table filtered to one provider or pricing model) or the whole table.
    ``deployment_options`` go to every :class:`~labkit.simulate.deployment.Deployment`
    (``max_model_len``, ``step_overhead_s``, ...). Rows that cannot serve come last, with the
    reason.
    """
    options = []
    for gpu in gpus:
        for dtype in weight_dtypes:
            for tp in tensor_parallel_sizes:
                options.append(_option(Deployment(model, gpu, tp, dtype, **deployment_options),
                                       slo, workload, traffic, prices))
    return sorted(options, key=lambda o: (o.problem is not None,
                                          o.fleet.monthly_usd if o.fleet else 0.0))


def _option(deployment: Deployment, slo: LatencySLO, workload: Workload,
            traffic: TrafficProfile, prices: Sequence[GPUPrice] | None) -> DeploymentOption:
    problem = deployment.problem()
    if problem is not None:
        return DeploymentOption(deployment, problem)
    try:
        price = gpu_hourly_price(deployment.gpu, num_gpus=deployment.num_gpus, table=prices)
    except ParameterError as err:
        return DeploymentOption(deployment, str(err))
    capacity = max_rate_at_slo(deployment, slo, workload)
    if not capacity.feasible:
        return DeploymentOption(deployment, f"misses {slo} at any load", capacity, price)
    return DeploymentOption(deployment, None, capacity, price,
                            token_cost(capacity.throughput(), price),
                            fixed_fleet_cost(capacity, traffic, price))


def comparison_table(options: Sequence[DeploymentOption]) -> str:
    """The comparison as a Markdown table, with the price row and date behind every cost."""
    lines = ["| deployment | req/s per replica at SLO | $/1M in | $/1M out | replicas "
             "| $/month | utilization | $/1M at that use | price (date) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for o in options:
        if o.problem is not None:
            lines.append(f"| {o.deployment.label} | {_short(o.problem)} | | | | | | | |")
            continue
        lines.append(
            f"| {o.deployment.label} | {o.capacity.max_request_rate:.1f} "
            f"| {o.cost.usd_per_1m_input:.3f} | {o.cost.usd_per_1m_output:.3f} "
            f"| {o.fleet.replicas:g} | {o.fleet.monthly_usd:,.0f} "
            f"| {o.fleet.utilization:.0%} | {o.fleet.usd_per_1m_tokens:.3f} "
            f"| {o.price.provider} ${o.price.usd_per_gpu_hour:.2f} ({o.price.as_of}) |")
    return "\n".join(lines)


def _short(problem: str) -> str:
    """A problem's first sentence, for a table cell."""
    return problem.split(". ")[0].replace("|", "/")


# ---------------------------------------------------------------------------------------------
# Autoscaling: replica-hours from chapter 5's fleet simulation
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AutoscaledCost:
    """A trace served by an autoscaled fleet, billed by the replica-hours it held
    (:ref:`ch06-month-of-traffic`; the simulation is chapter 5's). ``mean_replicas`` is the
    replica-seconds over the simulated time; the month assumes every day looks like the trace."""

    result: AutoscaleResult
    mean_replicas: float
    gpus_per_replica: int
    usd_per_gpu_hour: float
    monthly_usd: float
    ttft_slo_attainment: float

    @property
    def replica_hours(self) -> float:
        return self.result.replica_hours


def default_policy(capacity: SLOCapacity, max_replicas: int) -> HorizontalPodAutoscaler:
    """An HPA on ``vllm:num_requests_running`` with a target of the requests one replica
    holds at its SLO rate (Little's law: rate x mean end-to-end latency)
    (:ref:`ch05-hpa-kpa-keda`)."""
    summary = capacity.summary
    held = capacity.max_request_rate * summary.mean_e2el_ms / 1e3
    return HorizontalPodAutoscaler(RUNNING, max(1.0, round(held)), max_replicas=max_replicas,
                                   name=f"HPA running {max(1.0, round(held)):g}")


def autoscaled_fleet_cost(capacity: SLOCapacity, trace: Workload, price: GPUPrice | float, *,
                          policy: Policy | None = None, cold_start_s: float = COLD_START_S,
                          initial_replicas: int = 1) -> AutoscaledCost:
    """Serve ``trace`` with replicas of ``capacity.deployment`` that ``policy`` (default:
    :func:`~labkit.cost.compare.default_policy`, up to twice the replicas the trace's peak needs)
    scales, and bill the replica-hours (:ref:`ch06-month-of-traffic`).

    The trace's lengths should be the workload's: the SLO rate was found on those.
    TTFT SLO attainment is reported because scaling on a signal costs latency while new
    replicas start (``cold_start_s``, billed from the moment a replica is asked for).
    """
    if not capacity.feasible:
        raise ParameterError("capacity", "the deployment cannot meet its SLO at any load")
    usd = price.usd_per_gpu_hour if isinstance(price, GPUPrice) else price
    deployment = capacity.deployment
    _, rates = trace.rate(60.0)
    peak_replicas = replicas_needed(float(rates.max(initial=0.0)), capacity.max_request_rate)
    policy = policy or default_policy(capacity, 2 * peak_replicas)
    result = simulate_autoscaling(trace, policy, FleetConfig(deployment, cold_start_s),
                                  initial_replicas=initial_replicas)
    mean_replicas = result.replica_seconds / result.end_s
    return AutoscaledCost(result, mean_replicas, deployment.num_gpus, usd,
                          monthly_cost_usd(mean_replicas, deployment.num_gpus, usd),
                          result.slo_attainment(capacity.slo.p99_ttft_ms))
