"""Autoscaling policies against sequences worked out by hand from the documented algorithms
(chapter 5): the tutorial's scaler and its clock bug, Kubernetes' HPA, Knative's KPA, KEDA."""

import pytest

from labkit.autoscale import (CONCURRENCY, GPU_UTILIZATION, WAITING, GPUMetric,
                              HorizontalPodAutoscaler, HPAScalingPolicy, HPAScalingRules,
                              KedaAutoscaler, KnativePodAutoscaler, Observation, PodMetrics,
                              ThresholdPolicy, ThresholdRule, threshold_demo)
from labkit.tutorial.ch05_autoscaling import TutorialAutoScaler, tutorial_demo
from labkit.checks import ParameterError

values = Observation.from_values


def run_hpa(hpa, load, times, start):
    """Sync ``hpa`` at ``times``; every pod reports ``load(t)``; the fleet follows it."""
    replicas, out = start, []
    for t in times:
        replicas = hpa.decide(values(hpa.metric, [load(t)] * replicas), t)
        out.append(replicas)
    return out


# --- the tutorial's autoscaler ------------------------------------------------------------------

def test_tutorial_demo_prints_what_the_tutorial_prints():
    # Step 18 is the first whose last ten samples average above 80 % GPU utilization:
    # 40 + 3 * (18 - 4.5) = 80.5; queue (15 + 60) / 2 = 37.5; latency 500 + 100 * 13.5.
    (event,) = tutorial_demo()
    assert (event.step, event.action, event.replicas) == (18, "scale_up", 3)
    assert event.reason == "GPU 80% queue 38 latency 1850ms"
    # On its own demo the fixed policy agrees: 20 samples span 190 s, less than the cooldown.
    assert threshold_demo() == [event]


def test_tutorial_scaler_throws_away_samples_stamped_on_another_clock():
    # A replay from t = 0: every sample is older than time.time() - 300, dropped on arrival.
    assert tutorial_demo(start_s=0.0) == []
    assert [e.step for e in threshold_demo(start_s=0.0)] == [18]


OVERLOAD = dict(gpu_util=95.0, memory_util=90.0, queue_depth=80.0, avg_latency_ms=3000.0,
                requests_per_second=50.0)


def test_tutorial_cooldown_runs_on_the_wall_clock():
    # A replay 60 times faster than real time: samples 60 s apart, one wall second each.
    wall = iter(range(10**6, 10**6 + 10**4))
    scaler = TutorialAutoScaler(ThresholdRule(min_replicas=1, max_replicas=10),
                                wall_clock=lambda: float(next(wall)))
    for i in range(20):  # 19 minutes of samples, under a sustained overload
        scaler.add_metric(GPUMetric(10**6 + 60 * i, **OVERLOAD))
        scaler.evaluate()
    assert scaler.current_replicas == 2  # one scale-up, then "cooldown" for 300 wall seconds

    fixed = ThresholdPolicy(ThresholdRule(min_replicas=1, max_replicas=10))
    replicas, ups = 1, []
    for i in range(20):
        now = 60.0 * i
        fixed.add_metric(GPUMetric(now, **OVERLOAD), now)
        action, replicas, _ = fixed.evaluate(replicas, now)
        if action == "scale_up":
            ups.append(now)
    assert ups == [0.0, 300.0, 600.0, 900.0]  # once per 300 s of the samples' own clock
    assert replicas == 5


def test_fixed_policy_scales_at_time_zero():
    # "Never scaled" is None: with last_scale_time = 0 a clock starting at 0 would be in
    # cooldown for its first 300 s.
    policy = ThresholdPolicy(ThresholdRule(min_replicas=1, max_replicas=4))
    policy.add_metric(GPUMetric(0.0, **OVERLOAD), 0.0)
    assert policy.evaluate(1, 0.0)[:2] == ("scale_up", 2)


def test_threshold_policy_reads_the_fleet():
    policy = ThresholdPolicy(ThresholdRule(min_replicas=1, max_replicas=4))
    busy = Observation(2, (PodMetrics("a", True, {GPU_UTILIZATION: 90.0, WAITING: 0}),
                           PodMetrics("b", True, {GPU_UTILIZATION: 100.0, WAITING: 0})))
    assert policy.decide(busy, 0.0) == 3      # mean GPU utilization 95 % > 80 %
    assert policy.decide(busy, 15.0) == 2     # in cooldown: stays where the fleet is
    idle = Observation(2, (PodMetrics("a", True, {GPU_UTILIZATION: 5.0, WAITING: 0}),))
    assert ThresholdPolicy().decide(idle, 0.0) == 1


# --- Kubernetes HPA -----------------------------------------------------------------------------

def test_hpa_ratio_and_ceiling():
    # avg (10 + 13) / 2 = 11.5, ratio 2.3, ceil(2.3 * 2) = 5; the scale-up limit from 2 is
    # max(2 + 4, 2 * 2) = 6.
    hpa = HorizontalPodAutoscaler(WAITING, 5, max_replicas=10)
    assert hpa.decide(values(WAITING, [10, 13]), 0.0) == 5


@pytest.mark.parametrize("load, proposed, desired", [
    (11.0, 10, 10),     # ratio exactly 1.1: inside the tolerance, no change
    (11.001, 12, 12),   # ratio 1.1001: ceil(1.1001 * 10) = 12
    (9.0, 10, 10),      # ratio exactly 0.9: inside
    (8.999, 9, 10),     # ratio 0.8999 asks for 9; the initial recommendation (10) holds 300 s
])
def test_hpa_tolerance_edges(load, proposed, desired):
    hpa = HorizontalPodAutoscaler(WAITING, 10, max_replicas=50)
    assert hpa.decide(values(WAITING, [load] * 10), 0.0) == desired
    assert hpa.decisions[-1].proposed == proposed


def test_hpa_scale_down_waits_out_the_stabilization_window():
    # t = 0: 20 waiting per pod, target 5 -> ratio 4 -> 8, limited to max(2 + 4, 4) = 6.
    # Then nothing waits: every later proposal is 0, but the highest recommendation of the
    # last 300 s (8 at t = 0) holds the fleet at 6 until t = 300, when t = 0 leaves the
    # window; 100 %/15 s lets it drop to minReplicas at once.
    hpa = HorizontalPodAutoscaler(WAITING, 5, max_replicas=10)
    times = [15.0 * k for k in range(22)]
    assert run_hpa(hpa, lambda t: 20 if t == 0 else 0, times, 2) == [6] * 20 + [1, 1]
    assert [d.proposed for d in hpa.decisions[1:3]] == [0, 0]


@pytest.mark.parametrize("period, select, expected", [
    (15, "Max", [5, 10, 20, 40, 50, 50]),   # max(+4 pods, +100 %) per 15 s; maxReplicas 50
    (10, "Max", [5, 5, 10, 10, 20, 20]),    # synced every 10 s: each change counts 15 s
    (15, "Min", [2, 4, 8, 12, 16, 20]),     # min(+4 pods, +100 %)
])
def test_hpa_scale_up_rate_policies(period, select, expected):
    rules = HPAScalingRules(0, (HPAScalingPolicy("Pods", 4, 15),
                                HPAScalingPolicy("Percent", 100, 15)), select_policy=select)
    hpa = HorizontalPodAutoscaler(WAITING, 1, max_replicas=50, scale_up=rules)
    assert run_hpa(hpa, lambda t: 1000, [period * k for k in range(6)], 1) == expected


def test_hpa_scale_down_rate_policy_and_disabled():
    one_per_minute = HPAScalingRules(0, (HPAScalingPolicy("Pods", 1, 60),))
    hpa = HorizontalPodAutoscaler(WAITING, 1, max_replicas=10, scale_down=one_per_minute)
    assert run_hpa(hpa, lambda t: 0, [15.0 * k for k in range(6)], 5) == [4, 4, 4, 4, 3, 3]
    frozen = HPAScalingRules(0, (HPAScalingPolicy("Percent", 100, 15),),
                             select_policy="Disabled")
    hpa = HorizontalPodAutoscaler(WAITING, 1, max_replicas=10, scale_down=frozen)
    assert run_hpa(hpa, lambda t: 0, [15.0 * k for k in range(4)], 5) == [5] * 4


def test_hpa_missing_metrics_are_counted_conservatively():
    hpa = HorizontalPodAutoscaler(WAITING, 5, max_replicas=50)
    # Scale-down with a pod still loading: it counts as at target, (1 + 5) / 2 = 3 -> 0.6,
    # ceil(0.6 * 2) = 2: no scale-down (ignoring it would give ceil(0.2 * 1) = 1).
    assert hpa.metric_replicas(values(WAITING, [1, None]), 2) == 2
    # Scale-up with two pods loading: they count as 0, 10 / 3 = 3.333 -> 0.667 < 1 flips
    # the direction, so no change (ignoring them would give ceil(2 * 1) = 2, a scale-down).
    assert hpa.metric_replicas(values(WAITING, [10, None, None]), 3) == 3
    # Enough load for all: (20 + 20 + 0 + 0) / 4 = 10 -> 2.0, ceil(2.0 * 4) = 8.
    assert hpa.metric_replicas(values(WAITING, [20, 20, None, None]), 4) == 8
    # No metric at all: the controller reports an error and changes nothing.
    assert hpa.decide(values(WAITING, [None, None]), 0.0) == 2
    assert hpa.decisions[-1].proposed is None


def test_hpa_average_in_integer_milli_units():
    # (1000 + 1000 + 1001) // 3 = 1000 milli: ratio exactly 1.0 with target 1, where the
    # float mean (1.000333) would also be inside; 0.0001 rounds up to 1 milli.
    hpa = HorizontalPodAutoscaler(WAITING, 1, max_replicas=10)
    assert hpa.metric_replicas(values(WAITING, [1, 1, 1.0001]), 3) == 3
    assert hpa.metric_replicas(values(WAITING, [0.0001]), 1) == 1


def test_hpa_bounds_and_zero():
    hpa = HorizontalPodAutoscaler(WAITING, 5, min_replicas=2, max_replicas=4)
    assert hpa.decide(values(WAITING, [0] * 7), 0.0) == 4     # above max: to max at once
    assert hpa.decide(values(WAITING, [100]), 15.0) == 2      # below min: to min
    assert hpa.decide(Observation(0), 30.0) == 0              # at zero: scaling disabled


def test_hpa_external_average_value():
    # KEDA's HPA: 23 waiting in all, 5 per replica -> ceil(23 / 5) = 5 (ratio 2.3).
    hpa = HorizontalPodAutoscaler(WAITING, 5, max_replicas=10, metric_type="External")
    assert hpa.decide(values(WAITING, [10, 13]), 0.0) == 5
    # Within tolerance of target * pods, nothing changes: 10.5 / (5 * 2) = 1.05.
    hpa = HorizontalPodAutoscaler(WAITING, 5, max_replicas=10, metric_type="External")
    assert hpa.decide(values(WAITING, [5, 5.5]), 0.0) == 2


@pytest.mark.parametrize("kwargs, param", [
    (dict(target=0), "target"), (dict(min_replicas=0), "min_replicas"),
    (dict(min_replicas=3, max_replicas=2), "max_replicas"),
    (dict(metric_type="Object"), "metric_type"),
])
def test_hpa_rejects_bad_parameters(kwargs, param):
    with pytest.raises(ParameterError) as err:
        HorizontalPodAutoscaler(WAITING, **{"target": 5, **kwargs})
    assert err.value.param == param


def test_hpa_scaling_rules_ranges():
    with pytest.raises(ParameterError, match="stabilization_window_s"):
        HPAScalingRules(3601, (HPAScalingPolicy("Pods", 1, 15),))
    with pytest.raises(ParameterError, match="period_s"):
        HPAScalingPolicy("Pods", 1, 1801)
    with pytest.raises(ParameterError, match="select_policy"):
        HPAScalingRules(0, (HPAScalingPolicy("Pods", 1, 15),), select_policy="Avg")


# --- Knative KPA ------------------------------------------------------------------------------

def kpa(**kwargs):
    return KnativePodAutoscaler(container_concurrency_target=10, target_utilization=1.0,
                                **kwargs)


def test_kpa_defaults():
    k = KnativePodAutoscaler()
    assert k.target == pytest.approx(70.0)       # 100 in flight per pod, 70 % utilization
    assert (k.stable_window_s, k.panic_window_s, k.panic_threshold) == (60, 6, 2.0)
    assert (k.max_scale_up_rate, k.max_scale_down_rate, k.grace_period_s) == (1000, 2, 30)
    assert k.sync_period_s == 2.0


def test_kpa_enters_and_leaves_panic():
    # One pod, 5 in flight (target 10), a burst of 50 recorded for seconds 59 and 60.
    # t = 60: stable (58 * 5 + 2 * 50) / 60 = 6.5 -> 1 pod; panic (4 * 5 + 100) / 6 = 20
    # -> 2 pods = 2x the ready pods: panic. t = 62 and 64 the panic window still holds the
    # burst (120 / 6 = 20), extending the panic; from t = 66 it is calm, but panic ends only
    # after a stable window with no over-threshold tick: 64 + 60 < t, first at t = 126.
    k = kpa()
    out = {t: k.decide(values(CONCURRENCY, [50 if t == 60 else 5]), t) for t in range(0, 140, 2)}
    panicking = {d.time_s for d in k.decisions if d.panicking}
    assert panicking == set(range(60, 125, 2))
    assert all(out[t] == 1 for t in range(0, 60, 2))
    assert all(out[t] == 2 for t in range(60, 125, 2))  # no scale-down while panicking
    assert out[126] == 1
    assert k.decisions[30].panic_concurrency == pytest.approx(20.0)
    assert k.decisions[30].stable_concurrency == pytest.approx(6.5)


def test_kpa_starts_in_panic_and_limits_the_scale_down_rate():
    # Eight ready pods at start: panic with maxPanicPods = 8 until 0 + 60 < t. Then the
    # stable count (0) is floored at floor(8 / 2) = 4 by max-scale-down-rate 2.
    k = kpa()
    assert [k.decide(values(CONCURRENCY, [0] * 8), t) for t in (0, 60, 62)] == [8, 8, 4]


def test_kpa_scales_to_zero_after_the_grace_period():
    # 5 in flight until t = 10, then none. The stable average reaches 0 once t - 60 >= 10;
    # at t = 70 the revision (active since 0, for >= 60 s) is marked inactive; it goes to 0
    # when inactive for the 30 s grace period, at t = 100.
    k = kpa()
    out = {t: k.decide(values(CONCURRENCY, [5 if t <= 10 else 0]), t) for t in range(0, 110, 2)}
    assert all(out[t] == 1 for t in range(0, 100, 2))
    assert out[100] == 0
    assert [d.want for d in k.decisions if d.time_s in (68, 70)] == [1, 0]


def test_kpa_keeps_one_pod_for_a_stable_window_before_zero():
    # No traffic at all: active for less than the stable window -> 1; inactive at 60;
    # zero 30 s later.
    k = KnativePodAutoscaler()
    assert [k.decide(values(CONCURRENCY, [0]), t) for t in (0, 58, 60, 88, 90)] == [1, 1, 1, 1, 0]


def test_kpa_scales_from_zero_on_the_activators_queue():
    assert KnativePodAutoscaler().decide(Observation(0, queued=3), 0.0) == 1
    assert KnativePodAutoscaler(activation_scale=3).decide(Observation(0, queued=3), 0.0) == 3
    assert KnativePodAutoscaler(min_scale=2).decide(Observation(0), 0.0) == 2


def test_kpa_without_scale_to_zero_keeps_one():
    k = kpa(enable_scale_to_zero=False)
    assert [k.decide(values(CONCURRENCY, [0]), t) for t in (0, 60, 200)] == [1, 1, 1]


# --- KEDA ---------------------------------------------------------------------------------------

def test_keda_activation_decides_zero_to_one():
    keda = KedaAutoscaler(5, activation_threshold=2)
    assert keda.decide(Observation(0, queued=2), 0.0) == 0    # 2 > 2 is false: not active
    assert keda.decide(Observation(0, queued=3), 30.0) == 1   # active at zero: to 1
    assert KedaAutoscaler(5, min_replica_count=2).decide(Observation(0, queued=1), 0.0) == 2


def test_keda_hpa_decides_one_to_n():
    keda = KedaAutoscaler(5, max_replica_count=10)
    assert keda.decide(values(WAITING, [10, 13]), 0.0) == 5   # ceil(23 / 5)


def test_keda_scales_to_zero_after_the_cooldown():
    # Active at t = 0 (1 waiting), idle after. Polls every 30 s: the last active time plus
    # the 300 s cooldown must be *before* the poll, so 300 keeps the replica and 330 drops
    # it. Between polls the HPA (minReplicas 1) holds one replica.
    keda = KedaAutoscaler(5)
    out = {t: keda.decide(values(WAITING, [1 if t == 0 else 0]), float(t))
           for t in range(0, 345, 15)}
    assert all(out[t] == 1 for t in range(0, 330, 15))
    assert out[330] == 0
    # Never active: the initial cooldown (0 s) counts from creation.
    keda = KedaAutoscaler(5)
    assert [keda.decide(values(WAITING, [0]), t) for t in (0.0, 15.0, 30.0)] == [1, 1, 0]
