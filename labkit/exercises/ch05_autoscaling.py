"""Checks for the exercises of the chapter 5 autoscaling lab (``labs/05_autoscaling.ipynb``).

Every expected value is computed by running labkit's own policies
(:mod:`labkit.autoscale.hpa`, :mod:`labkit.autoscale.knative`), not by a second copy of their
formulas, so the checks agree with whatever the simulation and the lab show. The mistakes they name:

- HPA (Kubernetes "Horizontal Pod Autoscaling", kubernetes.io, "Algorithm details":
  ``desiredReplicas = ceil[currentReplicas * currentMetricValue / desiredMetricValue]``, no
  change while the ratio is within the tolerance, 0.1 by default): rounding down, the total
  where the average belongs, the tolerance forgotten, the scale-down stabilization window
  (300 s) misread;
- KPA (knative/serving, pkg/autoscaler/scaling/autoscaler.go, ``Scale``, read at commit
  00a4a55: ``dppc := math.Ceil(observedPanicValue / spec.TargetValue)`` and
  ``isOverPanicThreshold := dppc/readyPodsCount >= spec.PanicThreshold``): the pod count
  not rounded up, ``>`` for ``>=``, the 70 % target utilization left out, the threshold
  taken against one pod.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit.autoscale import (CONCURRENCY, WAITING, HorizontalPodAutoscaler,
                              KnativePodAutoscaler, Observation)
from labkit.checks import ParameterError, in_range, positive_int
from labkit.grading import Feedback, check_number
from labkit.units import ceil_tolerant


def _hpa_proposal(current: int, average: float, target: float) -> int:
    """What labkit's HPA asks for when ``current`` pods each report ``average`` (a Pods
    metric with an AverageValue ``target``), before stabilization and rate limits."""
    hpa = HorizontalPodAutoscaler(WAITING, target, max_replicas=max(1000, 10 * current))
    return hpa.metric_replicas(Observation.from_values(WAITING, [average] * current), current)


def check_hpa_desired_replicas(answer: object, current: int = 3, average: float = 7.0,
                               target: float = 5.0) -> Feedback:
    """Lab 05b, exercise 1: the replicas an HPA asks for when ``current`` replicas each
    report ``average`` waiting requests against a target of ``target`` per replica."""
    positive_int("current", current)
    in_range("average", average, 0)
    in_range("target", target, 0, low_open=True)
    expected = _hpa_proposal(current, average, target)
    ratio = average / target
    mistakes = {
        "rounded down instead of up (the HPA takes the ceiling)":
            math.floor(current * ratio),
        "used the fleet's total where the per-replica average belongs":
            math.ceil(current * current * ratio),
        "left out the current replica count (ceil(ratio) alone)": math.ceil(ratio),
    }
    return check_number(answer, expected, what="desired replicas", unit="replicas",
                        rel_tol=0, mistakes=mistakes)


def check_tolerance_replicas(answer: object, current: int = 10, average: float = 10.9,
                             target: float = 10.0) -> Feedback:
    """Lab 05b, exercise 2: the replicas an HPA asks for when the ratio may fall inside its
    10 % tolerance (then nothing changes)."""
    positive_int("current", current)
    in_range("average", average, 0)
    in_range("target", target, 0, low_open=True)
    expected = _hpa_proposal(current, average, target)
    return check_number(answer, expected, what="desired replicas", unit="replicas",
                        rel_tol=0, mistakes={
                            "ignored the 10 % tolerance (ceil(current * ratio) regardless)":
                                math.ceil(current * average / target),
                            "rounded down instead of up": math.floor(current * average / target)})


def replicas_after(recommendations: Sequence[tuple[float, int]], at_s: float,
                   sync_period_s: float = 15.0) -> int:
    """``spec.replicas`` right after the HPA's sync at ``at_s`` (chapter 5), when the metric
    recommends ``recommendations[i][1]`` replicas from time ``recommendations[i][0]`` on,
    with Kubernetes' default behaviour (scale-down stabilization 300 s, rate policies) and
    the fleet starting at the first recommendation.

    Run on labkit's HPA with an External metric and an AverageValue target of 1 (KEDA's
    kind): a total of ``r`` then asks for exactly ``r`` replicas whatever the fleet's size.
    """
    if not recommendations or recommendations[0][0] != 0:
        raise ParameterError("recommendations", "recommendations must start at time 0, "
                                                "as (from_s, replicas) pairs")
    starts = [t for t, _ in recommendations]
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise ParameterError("recommendations", "recommendation times must increase")
    for _, r in recommendations:
        positive_int("recommendations", r)
    in_range("at_s", at_s, 0)
    in_range("sync_period_s", sync_period_s, 0, low_open=True)
    highest = max(r for _, r in recommendations)
    hpa = HorizontalPodAutoscaler(WAITING, 1, max_replicas=highest, metric_type="External",
                                  sync_period_s=sync_period_s)
    replicas, syncs = recommendations[0][1], math.floor(at_s / sync_period_s + 1e-9)
    for k in range(syncs + 1):
        now = k * sync_period_s
        wanted = next(r for t, r in reversed(recommendations) if t <= now)
        # The whole total on one pod: the External metric only sums them.
        replicas = hpa.decide(Observation.from_values(WAITING, [wanted] + [0] * (replicas - 1)),
                              now)
    return replicas


DEFAULT_RECOMMENDATIONS = ((0.0, 8), (60.0, 3), (120.0, 5), (135.0, 2))
"""Exercise 3's metric: 8 replicas' worth of load, a drop at 60 s, a blip at 120 s, then 2."""


def check_replicas_after_window(answer: object,
                                recommendations: Sequence[tuple[float, int]] =
                                DEFAULT_RECOMMENDATIONS,
                                at_s: float = 405.0) -> Feedback:
    """Lab 05b, exercise 3: ``spec.replicas`` after the sync at ``at_s``, given the metric's
    recommendations over time and the default 300 s scale-down stabilization window."""
    expected = replicas_after(recommendations, at_s)

    def recommended(t: float) -> int:
        return next(r for start, r in reversed(recommendations) if start <= t)

    window = [r for t, r in recommendations if t <= at_s]
    mistakes = {
        "took the latest recommendation: the stabilization window keeps the highest of the "
        "last 300 s": recommended(at_s),
        "kept the highest recommendation ever; the window only looks back 300 s":
            max(window),
        "took the recommendation of exactly 300 s before; the window keeps the highest "
        "of all of them": recommended(max(0.0, at_s - 300)),
    }
    return check_number(answer, expected, what=f"spec.replicas at t = {at_s:g} s",
                        unit="replicas", rel_tol=0, mistakes=mistakes)


def panics(concurrency: float, ready_pods: int = 3, **kpa_options) -> bool:
    """Whether the KPA enters panic when ``concurrency`` requests have been in flight across
    ``ready_pods`` pods for a whole panic window, after a calm spell (chapter 5).

    Run on labkit's KPA: idle for two stable windows (long enough to leave the panic a new
    autoscaler starts in), then ``concurrency`` for every second of one panic window.
    """
    positive_int("ready_pods", ready_pods)
    in_range("concurrency", concurrency, 0)
    kpa = KnativePodAutoscaler(**kpa_options)
    tick = kpa.sync_period_s

    def decide(value: float, now: float) -> bool:
        kpa.decide(Observation.from_values(CONCURRENCY, [value / ready_pods] * ready_pods), now)
        return kpa.decisions[-1].panicking

    calm_until = 2 * kpa.stable_window_s
    t = 0.0
    while t < calm_until:
        decide(0.0, t)
        t += tick
    burst_start = t
    while t < burst_start + kpa.panic_window_s:
        decide(concurrency, t)
        t += tick
    return decide(concurrency, t)


def smallest_panic_concurrency(ready_pods: int = 3, **kpa_options) -> int:
    """The fewest requests in flight (a whole number) that put the KPA in panic over
    ``ready_pods`` pods (chapter 5), by bisection over :func:`panics` (panic is monotone in
    the load)."""
    low, high = 0, 1
    while not panics(high, ready_pods, **kpa_options):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if panics(mid, ready_pods, **kpa_options):
            high = mid
        else:
            low = mid
    return high


def check_panic_concurrency(answer: object, ready_pods: int = 3,
                            container_concurrency_target: float = 100.0,
                            target_utilization: float = 0.7) -> Feedback:
    """Lab 05b, exercise 4: the smallest whole number of requests in flight, held over the
    6 s panic window, that makes the KPA panic with ``ready_pods`` pods ready."""
    options = dict(container_concurrency_target=container_concurrency_target,
                   target_utilization=target_utilization)
    expected = smallest_panic_concurrency(ready_pods, **options)
    target = container_concurrency_target * target_utilization
    threshold = 2 * ready_pods  # panic-threshold-percentage 200
    mistakes = {
        "compared the unrounded pod count with the threshold; Knative rounds the pods up "
        "first": ceil_tolerant(threshold * target, 6),
        "required strictly more than twice the ready pods; the test is >=":
            math.floor(round(threshold * target, 6)) + 1,
        "used the container concurrency target without the 70 % target utilization":
            math.floor(round((threshold - 1) * container_concurrency_target, 6)) + 1,
        "compared with twice one pod, not twice the ready pods":
            math.floor(round(target, 6)) + 1,
        "compared with the ready pods, not 200 % of them":
            math.floor(round((ready_pods - 1) * target, 6)) + 1,
    }
    return check_number(answer, expected, what="requests in flight that trigger panic",
                        unit="requests", rel_tol=0, mistakes=mistakes)
