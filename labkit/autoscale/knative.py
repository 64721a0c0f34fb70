"""Knative's Pod Autoscaler (KPA) on an injected clock (:ref:`ch05-hpa-kpa-keda`): stable and panic
windows, scale rates, scale to zero after a grace period."""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.autoscale.observation import CONCURRENCY, Observation
from labkit.checks import ParameterError, in_range, positive_int

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
