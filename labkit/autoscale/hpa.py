"""Kubernetes' Horizontal Pod Autoscaler (``autoscaling/v2``) on an injected clock
(:ref:`ch05-hpa-kpa-keda`): ratio, tolerance, missing metrics, stabilization windows and rate
policies, as its controller computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.autoscale.observation import WAITING, Observation
from labkit.checks import ParameterError, in_range, positive_int
from labkit.units import ceil_tolerant

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
    return ceil_tolerant(value * 1000, 6)


def _usage_ratio(values, target_milli: int) -> float:
    """``GetMetricUsageRatio``: the average in integer milli-units (Go's ``/`` truncates;
    metric values are never negative here, so ``//`` is the same), over the target."""
    values = list(values)
    return (sum(values) // len(values)) / target_milli
