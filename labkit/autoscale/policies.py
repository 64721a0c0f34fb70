"""Autoscaling policies on an injected clock (chapter 5).

Every policy answers one question, ``decide(observation, now) -> replicas``: given what the
fleet looks like at time ``now`` (seconds, any origin), how many replicas should there be?
Time comes in as an argument and nothing reads the wall clock, so the same policy runs in a
simulation an hour long in seconds, in a test at hand-picked instants, or in a real control
loop that passes ``time.monotonic()``.

The policies:

- :class:`TutorialAutoScaler`, the tutorial's thresholds as it wrote them (its cooldown reads
  the wall clock: kept so the lab can show the bug) and :func:`tutorial_demo`, its demo;
  :class:`ThresholdPolicy`, the same rule with the clock fixed.
- :class:`HorizontalPodAutoscaler`, Kubernetes' HPA (``autoscaling/v2``) as its controller
  computes it: ratio, tolerance, missing metrics, stabilization windows, rate policies.
- :class:`KnativePodAutoscaler`, Knative's KPA: stable and panic windows, scale rates,
  scale to zero after a grace period.
- :class:`KedaAutoscaler`, a KEDA ScaledObject: activation decides 0 <-> 1, the HPA it
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

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from labkit.checks import ParameterError, in_range, positive_int

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GPU_UTILIZATION = "DCGM_FI_DEV_GPU_UTIL"  # NVIDIA DCGM exporter, percent
CONCURRENCY = "concurrency"  # Knative's metric: average requests in flight over the interval


# ---------------------------------------------------------------------------------------------
# What a policy sees
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# The tutorial's policy, as written and fixed
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUMetric:
    """One sample as the tutorial's autoscaler takes it (chapter 5; its field names,
    percentages 0-100)."""

    timestamp: float
    gpu_util: float
    memory_util: float
    queue_depth: float
    avg_latency_ms: float
    requests_per_second: float


@dataclass(frozen=True)
class ScaleEvent:
    """A decision the tutorial's demo prints: the demo step, the action, replicas after it."""

    step: int
    action: str
    replicas: int
    reason: str


@dataclass(frozen=True)
class ThresholdRule:
    """The tutorial's thresholds and its 5-minute cooldown (chapter 5's ``AutoScaler``)."""

    min_replicas: int = 1
    max_replicas: int = 10
    scale_up_threshold: float = 80.0     # GPU utilization, percent
    scale_down_threshold: float = 30.0
    cooldown_s: float = 300.0
    queue_threshold: float = 50.0
    latency_threshold_ms: float = 2000.0
    history_s: float = 300.0             # samples older than this are dropped
    window: int = 10                     # the decision averages the last ``window`` samples

    def __post_init__(self) -> None:
        positive_int("min_replicas", self.min_replicas)
        positive_int("max_replicas", self.max_replicas, at_least=self.min_replicas)
        in_range("cooldown_s", self.cooldown_s, 0)
        in_range("history_s", self.history_s, 0, low_open=True)
        positive_int("window", self.window)

    def verdict(self, recent: Sequence[GPUMetric]) -> tuple[str, str]:
        """``("up" | "down" | "none", reason)`` for the averages of ``recent``: up when any of
        GPU utilization, queue or latency is over its threshold, down when all are low."""
        n = len(recent)
        gpu = sum(m.gpu_util for m in recent) / n
        queue = sum(m.queue_depth for m in recent) / n
        latency = sum(m.avg_latency_ms for m in recent) / n
        if (gpu > self.scale_up_threshold or queue > self.queue_threshold
                or latency > self.latency_threshold_ms):
            return "up", f"GPU {gpu:.0f}% queue {queue:.0f} latency {latency:.0f}ms"
        if (gpu < self.scale_down_threshold and queue < 10
                and latency < self.latency_threshold_ms * 0.3):
            return "down", f"GPU {gpu:.0f}%, load low"
        return "none", f"GPU {gpu:.0f}%, steady"


class TutorialAutoScaler:
    """The tutorial's ``AutoScaler`` as it behaves, bugs included (chapter 5).

    Its samples carry their own timestamps, but two decisions read the wall clock,
    ``wall_clock()`` (``time.time`` by default, as in the tutorial):

    - the cooldown: ``wall_clock() - last_scale_time < cooldown``. Fed samples faster than
      real time (a replay, a simulation, its own demo), it scales once and then stays "in
      cooldown" for five minutes of *wall* time, whatever the samples' clock says;
    - the history: samples older than ``wall_clock() - 300`` are dropped as they arrive, so
      samples stamped on any other clock (a simulation starting at 0, yesterday's metrics)
      are all thrown away and it never scales at all.

    It also counts replicas itself (``current_replicas``) instead of reading them, so its
    count drifts from the real one as soon as anything else changes the Deployment.
    """

    def __init__(self, rule: ThresholdRule | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.rule = rule or ThresholdRule()
        self.wall_clock = wall_clock
        self.current_replicas = self.rule.min_replicas
        self.last_scale_time = 0.0  # the epoch: "long ago" only on the wall clock
        self.metrics_history: list[GPUMetric] = []

    def add_metric(self, metric: GPUMetric) -> None:
        self.metrics_history.append(metric)
        cutoff = self.wall_clock() - self.rule.history_s
        self.metrics_history = [m for m in self.metrics_history if m.timestamp > cutoff]

    def evaluate(self) -> tuple[str, int, str]:
        """``(action, replicas, reason)``: ``scale_up``, ``scale_down`` or ``none``."""
        if not self.metrics_history:
            return "none", self.current_replicas, "no metrics"
        verdict, reason = self.rule.verdict(self.metrics_history[-self.rule.window:])
        in_cooldown = self.wall_clock() - self.last_scale_time < self.rule.cooldown_s
        if verdict == "up" and not in_cooldown:
            if self.current_replicas < self.rule.max_replicas:
                self.current_replicas += 1
                self.last_scale_time = self.wall_clock()
                return "scale_up", self.current_replicas, reason
        elif verdict == "down" and not in_cooldown:
            if self.current_replicas > self.rule.min_replicas:
                self.current_replicas -= 1
                self.last_scale_time = self.wall_clock()
                return "scale_down", self.current_replicas, reason
        return "none", self.current_replicas, reason


def demo_metric(step: int, timestamp: float) -> GPUMetric:
    """Sample ``step`` of the tutorial's demo (chapter 5): a load that climbs every step (GPU
    utilization 40 % + 3 % a step, 97 % at step 19 of its 20)."""
    return GPUMetric(timestamp, gpu_util=40 + step * 3, memory_util=50 + step * 2,
                     queue_depth=max(0, step * 5 - 30), avg_latency_ms=500 + step * 100,
                     requests_per_second=10 + step * 2)


def tutorial_demo(steps: int = 20, interval_s: float = 10.0, start_s: float | None = None,
                  scaler: TutorialAutoScaler | None = None) -> list[ScaleEvent]:
    """The tutorial's demo (chapter 5): ``steps`` samples ``interval_s`` apart through its
    autoscaler (``min_replicas=2, max_replicas=8``), returning what it would print.

    With ``start_s=None`` the samples are stamped as the tutorial stamps them, in the recent
    past of the wall clock, and the demo prints one scale-up at step 18. Stamp them on a
    simulation clock instead (``start_s=0``) and the same autoscaler never scales. The demo's
    load also ignores the replicas added (an open loop); :mod:`labkit.autoscale.simulate`
    closes it.
    """
    positive_int("steps", steps)
    in_range("interval_s", interval_s, 0, low_open=True)
    scaler = scaler or TutorialAutoScaler(ThresholdRule(min_replicas=2, max_replicas=8))
    events = []
    for i in range(steps):
        stamp = (scaler.wall_clock() - (steps - i) * interval_s if start_s is None
                 else start_s + i * interval_s)
        scaler.add_metric(demo_metric(i, stamp))
        action, replicas, reason = scaler.evaluate()
        if action != "none":
            events.append(ScaleEvent(i, action, replicas, reason))
    return events


class ThresholdPolicy:
    """The tutorial's threshold rule with its clock fixed (chapter 5).

    The cooldown and the history are measured on the injected clock (``now``, the samples'
    own time base); "never scaled" is ``None``, not time 0 (with a clock that starts at 0,
    0 would read as "just scaled"); the current replica count is read from the observation
    instead of counted. What is left is still a weak policy: one replica per step, one
    cooldown for both directions, and a GPU-utilization threshold (see the module notes).
    """

    def __init__(self, rule: ThresholdRule | None = None, sync_period_s: float = 15.0,
                 name: str = "threshold") -> None:
        self.rule = rule or ThresholdRule()
        self.sync_period_s = in_range("sync_period_s", sync_period_s, 0, low_open=True)
        self.name = name
        self.last_scale_s: float | None = None
        self.history: list[GPUMetric] = []

    def add_metric(self, metric: GPUMetric, now: float) -> None:
        self.history.append(metric)
        cutoff = now - self.rule.history_s
        self.history = [m for m in self.history if m.timestamp > cutoff]

    def evaluate(self, current: int, now: float) -> tuple[str, int, str]:
        """``(action, replicas, reason)`` for a fleet of ``current`` replicas at ``now``."""
        if not self.history:
            return "none", current, "no metrics"
        verdict, reason = self.rule.verdict(self.history[-self.rule.window:])
        if self.last_scale_s is not None and now - self.last_scale_s < self.rule.cooldown_s:
            return "none", current, reason
        target = {"up": min(current + 1, self.rule.max_replicas),
                  "down": max(current - 1, self.rule.min_replicas)}.get(verdict, current)
        if target == current:
            return "none", current, reason
        self.last_scale_s = now
        return ("scale_up" if target > current else "scale_down"), target, reason

    def decide(self, observation: Observation, now: float) -> int:
        """Sample the fleet as the tutorial's metrics (mean GPU utilization of the ready
        replicas, requests waiting anywhere, mean latency) and apply the rule."""
        self.add_metric(GPUMetric(now, observation.mean(GPU_UTILIZATION), 0.0,
                                  observation.total(WAITING) + observation.queued,
                                  observation.mean_latency_ms, 0.0), now)
        current = min(max(observation.replicas, self.rule.min_replicas), self.rule.max_replicas)
        return self.evaluate(current, now)[1]


def threshold_demo(steps: int = 20, interval_s: float = 10.0, start_s: float = 0.0,
                   policy: ThresholdPolicy | None = None) -> list[ScaleEvent]:
    """The tutorial's demo through :class:`ThresholdPolicy`, on the samples' own clock
    (chapter 5)."""
    positive_int("steps", steps)
    in_range("interval_s", interval_s, 0, low_open=True)
    policy = policy or ThresholdPolicy(ThresholdRule(min_replicas=2, max_replicas=8))
    replicas, events = policy.rule.min_replicas, []
    for i in range(steps):
        now = start_s + i * interval_s
        policy.add_metric(demo_metric(i, now), now)
        action, replicas, reason = policy.evaluate(replicas, now)
        if action != "none":
            events.append(ScaleEvent(i, action, replicas, reason))
    return events


# ---------------------------------------------------------------------------------------------
# Kubernetes HPA (autoscaling/v2)
# ---------------------------------------------------------------------------------------------

HPA_TOLERANCE = 0.1
"""``--horizontal-pod-autoscaler-tolerance``: no change while the ratio is within 10 %
(kube-controller-manager default; pkg/controller/podautoscaler/config/v1alpha1/defaults.go)."""


@dataclass(frozen=True)
class HPAScalingPolicy:
    """``HPAScalingPolicy``: at most ``value`` pods (``Pods``) or percent (``Percent``) of
    the replicas at the start of any ``period_s``-second window."""

    type: str
    value: int
    period_s: int

    def __post_init__(self) -> None:
        if self.type not in ("Pods", "Percent"):
            raise ParameterError("type", f"type must be 'Pods' or 'Percent', got {self.type!r}")
        positive_int("value", self.value)
        # Kubernetes' validation: 0 < periodSeconds <= 1800 (MaxPeriodSeconds).
        positive_int("period_s", self.period_s)
        in_range("period_s", self.period_s, 1, 1800)


@dataclass(frozen=True)
class HPAScalingRules:
    """``HPAScalingRules`` for one direction: stabilization window, rate policies, how to
    pick among them (``Max``, ``Min`` or ``Disabled``) and the tolerance."""

    stabilization_window_s: int
    policies: tuple[HPAScalingPolicy, ...]
    select_policy: str = "Max"
    tolerance: float = HPA_TOLERANCE

    def __post_init__(self) -> None:
        # Kubernetes' validation: 0 <= stabilizationWindowSeconds <= 3600.
        positive_int("stabilization_window_s", self.stabilization_window_s, at_least=0)
        in_range("stabilization_window_s", self.stabilization_window_s, 0, 3600)
        if self.select_policy not in ("Max", "Min", "Disabled"):
            raise ParameterError("select_policy", f"select_policy must be 'Max', 'Min' or "
                                                  f"'Disabled', got {self.select_policy!r}")
        if not self.policies:
            raise ParameterError("policies", "policies must list at least one policy")
        in_range("tolerance", self.tolerance, 0)

    @property
    def longest_period_s(self) -> int:
        return max(p.period_s for p in self.policies)


DEFAULT_SCALE_UP = HPAScalingRules(0, (HPAScalingPolicy("Pods", 4, 15),
                                       HPAScalingPolicy("Percent", 100, 15)))
"""Scale up at once, by 4 pods or 100 % per 15 s, whichever is more (Kubernetes
pkg/apis/autoscaling/v2/defaults.go: ``defaultHPAScaleUpRules``)."""

DEFAULT_SCALE_DOWN = HPAScalingRules(300, (HPAScalingPolicy("Percent", 100, 15),))
"""Scale down to the highest recommendation of the last 300 s, by up to 100 % per 15 s
(``defaultHPAScaleDownRules``; the 300 s is ``--horizontal-pod-autoscaler-downscale-
stabilization``'s default, filled in by ``maybeInitScaleDownStabilizationWindow``)."""


@dataclass(frozen=True)
class HPADecision:
    """One sync of the HPA: the replicas the metric asked for, after the stabilization window,
    and after the rate limits (the new ``spec.replicas``)."""

    time_s: float
    current: int
    proposed: int | None   # None: no usable metric, nothing changes
    stabilized: int
    desired: int


class HorizontalPodAutoscaler:
    """Kubernetes' HPA for one metric, as the controller computes it (chapter 5).

    Followed in kubernetes/kubernetes ``pkg/controller/podautoscaler`` as of v1.33 and later
    (where the tolerance became per direction, ``Tolerances.isWithin``): ``reconcileAutoscaler``,
    ``normalizeDesiredReplicasWithBehaviors``, ``stabilizeRecommendationWithBehaviors``,
    ``convertDesiredReplicasWithBehaviorRate`` (horizontal.go) and
    ``calcPlainMetricReplicas`` / ``GetExternalPerPodMetricReplicas`` (replica_calculator.go);
    documented in "Horizontal Pod Autoscaling" (kubernetes.io, "Algorithm details").

    ``metric_type="Pods"``: each pod's value of ``metric`` (what a Prometheus adapter serves
    on ``custom.metrics.k8s.io``), ``target`` the average value per pod:

    - ratio = average / target, the average taken in integer milli-units as the controller
      does (``GetMetricUsageRatio``); within ``[1 - tolerance, 1 + tolerance]`` nothing
      changes, else desired = ceil(ratio * pods with metrics);
    - pods without the metric (a replica still loading its model) count, conservatively, as
      using 0 on a scale-up and exactly the target on a scale-down, the ratio is computed
      again, and nothing changes if that flips the direction or lands within tolerance.

    ``metric_type="External"`` with an ``AverageValue`` target (what KEDA creates): desired =
    ceil(total / target) unless total / (target * pods) is within tolerance.

    Then: the recommendation is stabilized, the highest of the last ``scale_down`` window
    and the lowest of the last ``scale_up`` window (0 s by default: no delay up, 300 s
    down), limited by the rate policies (scale-up: 4 pods or 100 % per 15 s, whichever is
    more; scale-down: 100 % per 15 s), and kept within ``[min_replicas, max_replicas]``.
    A Deployment at 0 replicas is left alone (autoscaling disabled): KEDA relies on that.
    The controller syncs every 15 s (``--horizontal-pod-autoscaler-sync-period``). An HPA
    with no ``spec.behavior`` at all takes an older path (``normalizeDesiredReplicas``: the
    same 300 s window down, but up to max(2 x current, 4) and no memory of recent changes);
    the manifests of :mod:`labkit.autoscale.manifests` always spell ``behavior`` out.
    """

    def __init__(self, metric: str = WAITING, target: float = 5.0, *, min_replicas: int = 1,
                 max_replicas: int = 10, metric_type: str = "Pods",
                 scale_up: HPAScalingRules = DEFAULT_SCALE_UP,
                 scale_down: HPAScalingRules = DEFAULT_SCALE_DOWN,
                 sync_period_s: float = 15.0, name: str = "HPA") -> None:
        in_range("target", target, 0, low_open=True)
        positive_int("min_replicas", min_replicas)
        positive_int("max_replicas", max_replicas, at_least=min_replicas)
        if metric_type not in ("Pods", "External"):
            raise ParameterError("metric_type", f"metric_type must be 'Pods' or 'External', "
                                                f"got {metric_type!r}")
        self.metric, self.target, self.metric_type = metric, target, metric_type
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.scale_up, self.scale_down = scale_up, scale_down
        self.sync_period_s = in_range("sync_period_s", sync_period_s, 0, low_open=True)
        self.name = name
        self.recommendations: list[tuple[float, int]] = []  # (time, unstabilized proposal)
        self.scale_up_events: list[tuple[float, int]] = []  # (time, replicas added)
        self.scale_down_events: list[tuple[float, int]] = []
        self.decisions: list[HPADecision] = []

    def decide(self, observation: Observation, now: float) -> int:
        """One ``reconcileAutoscaler``: the new ``spec.replicas``."""
        current = observation.replicas
        if not self.recommendations:  # recordInitialRecommendation
            self.recommendations.append((now, current))
        proposed = None
        if current == 0:  # minReplicas >= 1 here: scaling is disabled at zero
            stabilized = desired = 0
        elif current > self.max_replicas:
            stabilized = desired = self.max_replicas
        elif current < self.min_replicas:
            stabilized = desired = self.min_replicas
        else:
            proposed = self.metric_replicas(observation, current)
            if proposed is None:  # no metric: the controller reports an error, changes nothing
                stabilized = desired = current
            else:
                stabilized = self._stabilize(current, proposed, now)
                desired = self._limit_rate(current, stabilized, now)
        if desired != current:
            self._store_scale_event(current, desired, now)
        self.decisions.append(HPADecision(now, current, proposed, stabilized, desired))
        return desired

    # -- the metric's proposal (replica_calculator.go) --------------------------------------

    def _within_tolerance(self, ratio: float) -> bool:
        return 1.0 - self.scale_down.tolerance <= ratio <= 1.0 + self.scale_up.tolerance

    def metric_replicas(self, observation: Observation, current: int) -> int | None:
        """The replica count the metric alone asks for, before stabilization and rate limits
        (``None`` when no pod reports the metric)."""
        target = _milli(self.target)
        if self.metric_type == "External":
            usage = _milli(observation.total(self.metric)
                           + (observation.queued if self.metric == WAITING else 0))
            pods = len(observation.pods)  # scale.status.replicas
            ratio = usage / (target * pods) if pods else math.inf if usage else math.nan
            return pods if self._within_tolerance(ratio) else math.ceil(usage / target)
        metrics = {p.name: _milli(p.metrics[self.metric]) for p in observation.pods
                   if self.metric in p.metrics}
        if not metrics:
            return None
        missing = [p.name for p in observation.pods if self.metric not in p.metrics]
        ratio = _usage_ratio(metrics.values(), target)
        if not missing:
            return current if self._within_tolerance(ratio) else math.ceil(ratio * len(metrics))
        if ratio < 1.0:
            metrics.update(dict.fromkeys(missing, target))
        elif ratio > 1.0:
            metrics.update(dict.fromkeys(missing, 0))
        new_ratio = _usage_ratio(metrics.values(), target)
        if (self._within_tolerance(new_ratio) or (ratio < 1.0 < new_ratio)
                or (ratio > 1.0 > new_ratio)):
            return current
        proposal = math.ceil(new_ratio * len(metrics))
        if (new_ratio < 1.0 and proposal > current) or (new_ratio > 1.0 and proposal < current):
            return current
        return proposal

    # -- normalization with behaviors (horizontal.go) ---------------------------------------

    def _stabilize(self, current: int, proposed: int, now: float) -> int:
        """The lowest proposal of the scale-up window, the highest of the scale-down window,
        with ``current`` clamped between them; then this proposal joins the record."""
        up_cutoff = now - self.scale_up.stabilization_window_s
        down_cutoff = now - self.scale_down.stabilization_window_s
        up_limit = down_limit = proposed
        for t, replicas in self.recommendations:
            if t > up_cutoff:
                up_limit = min(up_limit, replicas)
            if t > down_cutoff:
                down_limit = max(down_limit, replicas)
        # Drop what no window will see again (the controller overwrites one such slot).
        self.recommendations = [(t, r) for t, r in self.recommendations
                                if not (t < up_cutoff and t < down_cutoff)]
        self.recommendations.append((now, proposed))
        return min(max(current, up_limit), down_limit)

    def _changes_within(self, period_s: int, now: float) -> tuple[int, int]:
        cutoff = now - period_s
        return (sum(n for t, n in self.scale_up_events if t > cutoff),
                sum(n for t, n in self.scale_down_events if t > cutoff))

    def _scale_up_limit(self, current: int, now: float) -> int:
        rules = self.scale_up
        if rules.select_policy == "Disabled":
            return current
        pick = min if rules.select_policy == "Min" else max
        proposals = []
        for p in rules.policies:
            added, removed = self._changes_within(p.period_s, now)
            start = current - added + removed  # replicas at the start of the period
            proposals.append(start + p.value if p.type == "Pods"
                             else math.ceil(start * (1 + p.value / 100)))
        return pick(proposals)

    def _scale_down_limit(self, current: int, now: float) -> int:
        rules = self.scale_down
        if rules.select_policy == "Disabled":
            return current
        pick = max if rules.select_policy == "Min" else min  # the smaller change is "Min"
        proposals = []
        for p in rules.policies:
            added, removed = self._changes_within(p.period_s, now)
            start = current - added + removed
            proposals.append(start - p.value if p.type == "Pods"
                             else int(start * (1 - p.value / 100)))  # Go's int32(): truncates
        return pick(proposals)

    def _limit_rate(self, current: int, stabilized: int, now: float) -> int:
        if stabilized > current:
            ceiling = min(self.max_replicas, max(current, self._scale_up_limit(current, now)))
            return min(stabilized, ceiling)
        if stabilized < current:
            floor = max(self.min_replicas, min(current, self._scale_down_limit(current, now)))
            return max(stabilized, floor)
        return stabilized

    def _store_scale_event(self, current: int, desired: int, now: float) -> None:
        if desired > current:
            events, change, rules = self.scale_up_events, desired - current, self.scale_up
        else:
            events, change, rules = self.scale_down_events, current - desired, self.scale_down
        cutoff = now - rules.longest_period_s  # older events no longer limit anything
        events[:] = [(t, n) for t, n in events if t >= cutoff]
        events.append((now, change))


def _milli(value: float) -> int:
    """A metric value as the HPA holds it: a Kubernetes quantity's ``MilliValue()``, which
    rounds up (the rounding at 6 decimals only absorbs binary floating-point noise)."""
    return math.ceil(round(value * 1000, 6))


def _usage_ratio(values, target_milli: int) -> float:
    """``GetMetricUsageRatio``: the average in integer milli-units (Go's ``/`` truncates;
    metric values are never negative here, so ``//`` is the same), over the target."""
    values = list(values)
    return (sum(values) // len(values)) / target_milli


# ---------------------------------------------------------------------------------------------
# Knative KPA
# ---------------------------------------------------------------------------------------------

class _WindowAverage:
    """Knative's ``TimedFloat64Buckets`` with 1-second buckets: the average over the last
    ``window_s`` seconds of the values recorded per second, counting only the seconds since
    the first write (pkg/autoscaler/aggregation/bucketing.go, ``Record``/``WindowAverage``)."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self.buckets: dict[int, float] = {}
        self.first: int | None = None
        self.last: int | None = None

    def record(self, second: int, value: float) -> None:
        if self.last is not None and second <= self.last - self.window_s:
            return  # older than the window
        if self.last is None or second - self.last >= self.window_s:
            self.buckets, self.first = {}, second  # silent for a whole window: start over
        self.first = min(self.first, second)
        self.last = second if self.last is None else max(self.last, second)
        self.buckets[second] = self.buckets.get(second, 0.0) + value
        for old in [s for s in self.buckets if s <= self.last - self.window_s]:
            del self.buckets[old]

    def average(self, now: float) -> float:
        if self.last is None:
            return 0.0
        idle = math.floor(now) - self.last
        if idle >= self.window_s:  # nothing recorded for a whole window
            return 0.0
        # The buckets hold the window that ends at the last write; seconds that have since
        # left the window no longer count, in the sum or in the number of seconds.
        total = sum(v for s, v in self.buckets.items() if s > self.last - self.window_s + idle)
        seconds = min(self.last - self.first + 1, self.window_s - max(idle, 0))
        return round(total / seconds, 6)  # Knative rounds to 6 digits


@dataclass(frozen=True)
class KPADecision:
    """One tick of the KPA: the windowed averages, the pod counts they ask for, the mode."""

    time_s: float
    stable_concurrency: float
    panic_concurrency: float
    desired_stable: int
    desired_panic: int
    panicking: bool
    want: int        # the decider's answer
    desired: int     # after min/max scale and the scale-to-zero rules


class KnativePodAutoscaler:
    """Knative's Pod Autoscaler (KPA) on concurrency (chapter 5).

    Defaults are the ``config-autoscaler`` ConfigMap's, checked in knative/serving
    (knative-v1.23.0, pkg/autoscaler/config/config.go): container-concurrency-target-default
    100, target-utilization-percentage 70 (so 70 requests in flight per pod), stable-window
    60 s, panic-window-percentage 10 (6 s), panic-threshold-percentage 200, max-scale-up-rate
    1000, max-scale-down-rate 2, scale-to-zero-grace-period 30 s, enable-scale-to-zero true;
    the decider ticks every 2 s (pkg/autoscaler/scaling/multiscaler.go, ``tickInterval``).

    Each tick (pkg/autoscaler/scaling/autoscaler.go, ``Scale``): the total concurrency (pods'
    plus requests held by the activator) is averaged over the stable and the panic window in
    1-second buckets; each average over the target gives a pod count, rounded up and kept
    within ``[floor(ready / max_scale_down_rate), ceil(ready * max_scale_up_rate)]``. The
    KPA enters panic when the panic count reaches ``panic_threshold`` times the ready pods,
    stays while it does, and leaves only a full stable window after the last time it did; in
    panic it follows the larger count and never scales down.

    Scale to zero (pkg/reconciler/autoscaling/kpa/scaler.go, ``handleScaleToZero``): when the
    decider wants 0, a revision active for less than a stable window goes to 1; then it is
    marked inactive, and goes to 0 once inactive for the grace period. Simplified here: the
    activator is taken to be in the request path at once (Knative probes for it), and
    activation never times out.
    """

    def __init__(self, *, container_concurrency_target: float = 100.0,
                 target_utilization: float = 0.7, stable_window_s: int = 60,
                 panic_window_percentage: float = 10.0,
                 panic_threshold_percentage: float = 200.0, max_scale_up_rate: float = 1000.0,
                 max_scale_down_rate: float = 2.0, scale_to_zero_grace_period_s: float = 30.0,
                 enable_scale_to_zero: bool = True, min_scale: int = 0, max_scale: int = 0,
                 activation_scale: int = 1, sync_period_s: float = 2.0,
                 name: str = "KPA") -> None:
        in_range("container_concurrency_target", container_concurrency_target, 0,
                 low_open=True)
        in_range("target_utilization", target_utilization, 0, 1, low_open=True)
        positive_int("stable_window_s", stable_window_s, at_least=6)  # Knative: 6 s .. 1 h
        in_range("stable_window_s", stable_window_s, 6, 3600)
        in_range("panic_window_percentage", panic_window_percentage, 1, 100)
        in_range("panic_threshold_percentage", panic_threshold_percentage, 110, 1000)
        in_range("max_scale_up_rate", max_scale_up_rate, 1, low_open=True)
        in_range("max_scale_down_rate", max_scale_down_rate, 1, low_open=True)
        in_range("scale_to_zero_grace_period_s", scale_to_zero_grace_period_s, 0)
        positive_int("min_scale", min_scale, at_least=0)
        positive_int("max_scale", max_scale, at_least=0)  # 0: unbounded
        if max_scale and max_scale < min_scale:
            raise ParameterError("max_scale", f"max_scale must be 0 (unbounded) or >= min_scale "
                                              f"({min_scale}), got {max_scale}")
        positive_int("activation_scale", activation_scale)
        self.target = max(0.01, container_concurrency_target * target_utilization)  # TargetMin
        self.stable_window_s = stable_window_s
        self.panic_window_s = max(1, round(stable_window_s * panic_window_percentage / 100))
        self.panic_threshold = panic_threshold_percentage / 100
        self.max_scale_up_rate, self.max_scale_down_rate = max_scale_up_rate, max_scale_down_rate
        self.grace_period_s = scale_to_zero_grace_period_s
        self.enable_scale_to_zero = enable_scale_to_zero
        self.min_scale, self.max_scale = min_scale, max_scale
        self.activation_scale = activation_scale
        self.sync_period_s = in_range("sync_period_s", sync_period_s, 0, low_open=True)
        self.name = name
        self.stable = _WindowAverage(stable_window_s)
        self.panic = _WindowAverage(self.panic_window_s)
        self.last_recorded: int | None = None
        self.started = False
        self.panic_since: float | None = None  # Knative's panicTime: last time over threshold
        self.max_panic_pods = 0
        self.active_since: float | None = None
        self.inactive_since: float | None = None
        self.decisions: list[KPADecision] = []

    def record(self, concurrency: float, now: float) -> None:
        """Record the total concurrency at ``now`` in every 1-second bucket since the last
        record: Knative scrapes each second, the decider runs every other."""
        second = math.floor(now)
        first = second if self.last_recorded is None else self.last_recorded + 1
        for s in range(max(first, second - self.stable_window_s + 1), second + 1):
            self.stable.record(s, concurrency)
            self.panic.record(s, concurrency)
        self.last_recorded = second if self.last_recorded is None else max(second,
                                                                           self.last_recorded)

    def decide(self, observation: Observation, now: float) -> int:
        """One tick: record the concurrency, run the decider, then the reconciler's rules."""
        ready = observation.ready_pods
        self.record(observation.total(CONCURRENCY) + observation.queued, now)
        if not self.started:  # a new autoscaler starts in panic over more than one pod
            self.started = True
            if ready > 1:
                self.panic_since, self.max_panic_pods = now, ready
        want, stable, panic, stable_pods, panic_pods = self._scale(ready, now)
        desired = self._reconcile(observation.replicas, ready, want, now)
        self.decisions.append(KPADecision(now, stable, panic, stable_pods, panic_pods,
                                          self.panic_since is not None, want, desired))
        return desired

    def _scale(self, ready: int, now: float) -> tuple[int, float, float, int, int]:
        pods = max(1.0, float(ready))
        max_up = math.ceil(self.max_scale_up_rate * pods)
        max_down = math.floor(pods / self.max_scale_down_rate)
        stable, panic = self.stable.average(now), self.panic.average(now)
        dspc, dppc = math.ceil(stable / self.target), math.ceil(panic / self.target)
        stable_pods = int(min(max(dspc, max_down), max_up))
        panic_pods = int(min(max(dppc, max_down), max_up))
        if self.activation_scale > 1:
            if dspc > 0:
                stable_pods = max(stable_pods, self.activation_scale)
            if dppc > 0:
                panic_pods = max(panic_pods, self.activation_scale)
        over = dppc / pods >= self.panic_threshold
        if over:
            self.panic_since = now  # enter, or extend
        elif self.panic_since is not None and self.panic_since + self.stable_window_s < now:
            self.panic_since, self.max_panic_pods = None, 0
        want = stable_pods
        if self.panic_since is not None:
            self.max_panic_pods = max(self.max_panic_pods, want, panic_pods)
            want = self.max_panic_pods
        return want, stable, panic, stable_pods, panic_pods

    def _reconcile(self, current: int, ready: int, want: int, now: float) -> int:
        """The KPA reconciler: min/max scale, then the scale-to-zero rules."""
        desired = max(want, self.min_scale)
        if self.max_scale:
            desired = min(desired, self.max_scale)
        if ready and self.inactive_since is None and self.active_since is None:
            self.active_since = now  # Active: ready pods and not marked inactive
        if desired > 0:
            if self.inactive_since is not None:  # traffic again: activating
                self.inactive_since, self.active_since = None, (now if ready else None)
            return desired
        if not self.enable_scale_to_zero:
            return 1
        if self.inactive_since is None:
            if self.active_since is None:  # activating: no pod ready yet, wait for one
                return current
            if now - self.active_since < self.stable_window_s:
                return 1
            self.inactive_since, self.active_since = now, None  # marked inactive
            return current
        return 0 if now - self.inactive_since >= self.grace_period_s else current


# ---------------------------------------------------------------------------------------------
# KEDA
# ---------------------------------------------------------------------------------------------

class KedaAutoscaler:
    """A KEDA ScaledObject with one prometheus trigger (chapter 5).

    Two loops, as in KEDA (kedacore/keda v2.20.2, pkg/scaling/executor/
    scale_scaledobjects.go, ``RequestScale``): every ``polling_interval_s`` (default 30)
    KEDA queries the metric; the trigger is active when the value is above
    ``activation_threshold`` (pkg/scalers/prometheus_scaler.go: ``val >
    activationThreshold``, default 0). Active at 0 replicas: scale to ``min_replica_count``
    or 1. Inactive with replicas and ``min_replica_count`` 0: scale to 0 once
    ``cooldown_period_s`` (default 300) has passed since the trigger was last active. Between
    1 and N the HPA KEDA creates decides, on an External metric with an AverageValue target of
    ``threshold`` (KEDA's default metric type; HPA minReplicas = max(min_replica_count, 1),
    maxReplicas = ``max_replica_count``, default 100).

    The value is the fleet's ``sum(vllm:num_requests_waiting)`` plus the requests held in
    front of it: with no replica there is no engine to report waiting requests, which is why
    production-stack's scale-to-zero recipe adds a trigger on its router's
    ``vllm:num_incoming_requests_total`` (docs "Autoscaling with KEDA").
    """

    def __init__(self, threshold: float = 5.0, *, activation_threshold: float = 0.0,
                 min_replica_count: int = 0, max_replica_count: int = 100,
                 polling_interval_s: float = 30.0, cooldown_period_s: float = 300.0,
                 initial_cooldown_period_s: float = 0.0, metric: str = WAITING,
                 scale_up: HPAScalingRules = DEFAULT_SCALE_UP,
                 scale_down: HPAScalingRules = DEFAULT_SCALE_DOWN,
                 hpa_sync_period_s: float = 15.0, name: str = "KEDA") -> None:
        in_range("activation_threshold", activation_threshold, 0)
        positive_int("min_replica_count", min_replica_count, at_least=0)
        positive_int("max_replica_count", max_replica_count, at_least=max(min_replica_count, 1))
        self.polling_interval_s = in_range("polling_interval_s", polling_interval_s, 0,
                                           low_open=True)
        self.cooldown_period_s = in_range("cooldown_period_s", cooldown_period_s, 0)
        self.initial_cooldown_period_s = in_range("initial_cooldown_period_s",
                                                  initial_cooldown_period_s, 0)
        self.activation_threshold = activation_threshold
        self.min_replica_count = min_replica_count
        self.metric = metric
        self.hpa = HorizontalPodAutoscaler(
            metric, threshold, min_replicas=max(min_replica_count, 1),
            max_replicas=max_replica_count, metric_type="External", scale_up=scale_up,
            scale_down=scale_down, sync_period_s=hpa_sync_period_s, name=f"{name}'s HPA")
        self.sync_period_s = min(hpa_sync_period_s, polling_interval_s)
        self.name = name
        self.created_s: float | None = None
        self.last_poll_s: float | None = None
        self.last_active_s: float | None = None
        self.next_hpa_s: float | None = None

    def value(self, observation: Observation) -> float:
        """The trigger's query result: waiting requests in the fleet and in front of it."""
        return observation.total(self.metric) + (observation.queued
                                                 if self.metric == WAITING else 0)

    def decide(self, observation: Observation, now: float) -> int:
        """KEDA's poll when one is due (it may scale 0 <-> N on its own), else the HPA's sync
        when due; between both, nothing changes."""
        if self.created_s is None:
            self.created_s = now
        current = observation.replicas
        if self.last_poll_s is None or now - self.last_poll_s >= self.polling_interval_s:
            self.last_poll_s = now
            scaled = self._poll(current, self.value(observation) > self.activation_threshold,
                                now)
            if scaled != current:
                return scaled
        if self.next_hpa_s is None or now >= self.next_hpa_s:
            self.next_hpa_s = now + self.hpa.sync_period_s
            return self.hpa.decide(observation, now)
        return current

    def _poll(self, current: int, active: bool, now: float) -> int:
        if active:
            self.last_active_s = now
            return max(self.min_replica_count, 1) if current == 0 else current
        if current > 0 and self.min_replica_count == 0:
            quiet_since, wait = ((self.created_s, self.initial_cooldown_period_s)
                                 if self.last_active_s is None
                                 else (self.last_active_s, self.cooldown_period_s))
            return 0 if quiet_since + wait < now else current
        return max(current, self.min_replica_count)
