"""The tutorial's threshold rule on an injected clock (:ref:`ch05-tutorial-wrong`).

:class:`ThresholdRule` holds the tutorial's thresholds and cooldown, :class:`GPUMetric` its
sample; :class:`ThresholdPolicy` applies the rule on the clock every policy here takes (the
tutorial's own ``AutoScaler``, which reads the wall clock, is
:class:`labkit.tutorial.ch05_autoscaling.TutorialAutoScaler`). :func:`demo_metric` is the load
of the tutorial's demo and :func:`threshold_demo` runs it through the fixed policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.autoscale.observation import GPU_UTILIZATION, WAITING, Observation
from labkit.checks import in_range, positive_int


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


def demo_metric(step: int, timestamp: float) -> GPUMetric:
    """Sample ``step`` of the tutorial's demo (chapter 5): a load that climbs every step (GPU
    utilization 40 % + 3 % a step, 97 % at step 19 of its 20)."""
    return GPUMetric(timestamp, gpu_util=40 + step * 3, memory_util=50 + step * 2,
                     queue_depth=max(0, step * 5 - 30), avg_latency_ms=500 + step * 100,
                     requests_per_second=10 + step * 2)


class ThresholdPolicy:
    """The tutorial's threshold rule with its clock fixed (chapter 5).

    The cooldown and the history are measured on the injected clock (``now``, the samples'
    own time base); "never scaled" is ``None``, not time 0 (with a clock that starts at 0,
    0 would read as "just scaled"); the current replica count is read from the observation
    instead of counted. What is left is still a weak policy: one replica per step, one
    cooldown for both directions, and a GPU-utilization threshold (:ref:`ch05-tutorial-wrong`).
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
