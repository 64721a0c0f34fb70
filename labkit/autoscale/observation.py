"""What an autoscaling policy sees, and the interface every policy has
(:ref:`ch05-autoscaling-signal`).

Every policy answers one question, ``decide(observation, now) -> replicas``: given what the
fleet looks like at time ``now`` (seconds, any origin), how many replicas should there be?
Time comes in as an argument and nothing reads the wall clock, so the same policy runs in a
simulation an hour long in seconds, in a test at hand-picked instants, or in a real control
loop that passes ``time.monotonic()``.

The policies, each in its own module:

- :mod:`~labkit.autoscale.threshold`: ``ThresholdPolicy``, the tutorial's thresholds with the
  clock fixed, and its demo (the tutorial's own autoscaler, whose cooldown reads the wall
  clock, is kept in :mod:`labkit.tutorial.ch05_autoscaling` so the lab can show the bug).
- :mod:`~labkit.autoscale.hpa`: Kubernetes' HPA (``autoscaling/v2``) as its controller
  computes it: ratio, tolerance, missing metrics, stabilization windows, rate policies.
- :mod:`~labkit.autoscale.knative`: Knative's KPA: stable and panic windows, scale rates,
  scale to zero after a grace period.
- :mod:`~labkit.autoscale.keda`: a KEDA ScaledObject: activation decides 0 <-> 1, the HPA it
  creates decides 1..N.

Signals (the names are the servers' own): ``vllm:num_requests_waiting`` per replica is what
vLLM's production-stack scales on (docs "Autoscaling with KEDA", production-stack v0.1.7 and
later: a KEDA prometheus trigger on it with ``threshold: '5'``) and what GKE recommends as
"queue size" to maximise throughput within a latency target, with "batch size" (requests
running) for tighter latency targets (Google Cloud, "Best practices for autoscaling LLM
inference workloads with GPUs on GKE"). ``vllm:kv_cache_usage_perc`` says how close a
replica is to preempting; Knative's ``concurrency`` is the average number of requests in
flight.

Why not GPU utilization: ``DCGM_FI_DEV_GPU_UTIL`` is a duty cycle, the share of time some
kernel was running, and "does not measure how much work the GPU does while active" (same GKE
page). A vLLM replica decoding one sequence and one decoding two hundred both read close to
100 %, so the signal saturates long before the replica does and says nothing about queueing;
the simulation (:mod:`labkit.autoscale.simulate`) reports it beside the others to show it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from labkit.checks import positive_int

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GPU_UTILIZATION = "DCGM_FI_DEV_GPU_UTIL"  # NVIDIA DCGM exporter, percent
CONCURRENCY = "concurrency"  # Knative's metric: average requests in flight over the interval


@dataclass(frozen=True)
class PodMetrics:
    """One replica as an autoscaler sees it: ready or not, and the metrics it exports.

    ``metrics`` is empty while the replica starts: a vLLM server serves ``/metrics`` from
    the same HTTP server as the API, which comes up only after the model is loaded.
    """

    name: str
    ready: bool
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """What a policy sees at one sync (chapter 5).

    ``replicas`` is the Deployment's ``spec.replicas``, what the autoscaler last asked for;
    ``pods`` are the replicas that exist and are not being deleted (ready or starting);
    ``queued`` counts requests held in front of the fleet because no replica was ready (at
    the gateway, or Knative's activator); ``mean_latency_ms`` is the mean end-to-end latency
    of the requests that finished since the previous observation (0 when none did).
    """

    replicas: int
    pods: tuple[PodMetrics, ...] = ()
    queued: int = 0
    mean_latency_ms: float = 0.0

    def __post_init__(self) -> None:
        positive_int("replicas", self.replicas, at_least=0)
        positive_int("queued", self.queued, at_least=0)

    @classmethod
    def from_values(cls, metric: str, values: Sequence[float | None], *,
                    replicas: int | None = None, queued: int = 0) -> Observation:
        """Pods ``pod-0``, ``pod-1``, ... exporting ``metric`` with these values; ``None`` is a
        pod that is not ready and exports nothing yet. ``replicas`` defaults to the pod count."""
        pods = tuple(PodMetrics(f"pod-{i}", v is not None, {} if v is None else {metric: v})
                     for i, v in enumerate(values))
        return cls(len(pods) if replicas is None else replicas, pods, queued)

    @property
    def ready_pods(self) -> int:
        return sum(p.ready for p in self.pods)

    def total(self, metric: str) -> float:
        """Sum of ``metric`` over the pods that export it (PromQL ``sum(metric)``)."""
        return sum(p.metrics[metric] for p in self.pods if metric in p.metrics)

    def mean(self, metric: str) -> float:
        """Mean of ``metric`` over the pods that export it; 0 when none does."""
        values = [p.metrics[metric] for p in self.pods if metric in p.metrics]
        return sum(values) / len(values) if values else 0.0


class Policy(Protocol):
    """An autoscaling policy: called every ``sync_period_s`` seconds with the fleet's state."""

    name: str
    sync_period_s: float

    def decide(self, observation: Observation, now: float) -> int:
        """The number of replicas there should be at time ``now`` (seconds)."""
