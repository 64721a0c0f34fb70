"""labkit.monitor.alerts (chapter 8): alert state sequences on scripted series, with the
semantics of Prometheus' rules/alerting.go (v3.9.1): pending when the condition first
holds, firing once it has held for ``for``, resolved when it stops."""

import pytest

from labkit.checks import ParameterError
from labkit.monitor.alerts import (AlertRule, AlertState, RuleEvaluator, backend_down,
                                   error_ratio_above, kv_usage_above, preemption_rate_above,
                                   ttft_p99_above, waiting_queue_above)
from labkit.monitor.series import SeriesStore

A = (("engine", "0"), ("instance", "a:8000"))


def play(rule: AlertRule, name: str, values, labels=None, step_s: float = 10.0):
    """Write ``values`` of gauge ``name`` every ``step_s`` seconds from t=0, evaluating
    ``rule`` after each; returns [(t, state), ...] of the events."""
    store = SeriesStore()
    evaluator = RuleEvaluator([rule], store)
    events = []
    for i, value in enumerate(values):
        store.add(name, labels or dict(A), i * step_s, value)
        events += [(e.t_s, e.state) for e in evaluator.evaluate(i * step_s)]
    return events, evaluator


def test_queue_alert_goes_pending_then_firing_after_for_then_resolved():
    # Over 4 from t=10; held 30 s at t=40 (40 - 10 >= 30): firing; back to 0 at t=50.
    events, evaluator = play(waiting_queue_above(4, for_s=30), "vllm:num_requests_waiting",
                             [0, 5, 6, 7, 8, 0, 0])
    assert events == [(10, "pending"), (40, "firing"), (50, "resolved")]
    (alert,) = evaluator.alerts()
    assert (alert.state, alert.active_at_s, alert.fired_at_s, alert.resolved_at_s) == \
        (AlertState.INACTIVE, 10, 40, 50)
    assert alert.labels == A


def test_a_blip_shorter_than_for_never_fires():
    events, evaluator = play(waiting_queue_above(4, for_s=30), "vllm:num_requests_waiting",
                             [0, 9, 0, 0])
    assert events == [(10, "pending"), (20, "inactive")]
    assert evaluator.alerts() == []


def test_for_zero_fires_at_once_and_keep_firing_for_holds_it():
    # keep_firing_for 20 s: absent from t=20, still firing at 30 (10 s), resolved at 40.
    rule = AlertRule("Kv", kv_usage_above(0.9).condition, "x", keep_firing_for_s=20)
    events, _ = play(rule, "vllm:kv_cache_usage_perc", [0.5, 0.95, 0.5, 0.5, 0.5])
    assert events == [(10, "pending"), (10, "firing"), (40, "resolved")]


def test_a_resolved_alert_can_fire_again_and_is_forgotten_after_15_minutes():
    events, evaluator = play(kv_usage_above(0.9), "vllm:kv_cache_usage_perc",
                             [1, 0, 1, 0] + [0] * 91)
    assert events == [(0, "pending"), (0, "firing"), (10, "resolved"),
                      (20, "pending"), (20, "firing"), (30, "resolved")]
    # Resolved at 30: kept while 30 + 900 >= t; gone at the next evaluation after that.
    assert evaluator.alerts() == []


def test_backend_down_from_up_series():
    events, evaluator = play(backend_down(for_s=20), "up", [1, 1, 0, 0, 0, 1],
                             labels={"instance": "a:8000", "job": "labkit"})
    assert events == [(20, "pending"), (40, "firing"), (50, "resolved")]
    assert evaluator.state("BackendDown") is AlertState.INACTIVE


def test_p99_ttft_from_histogram_buckets():
    # TTFT observations per 10 s: 90 under 0.1 s, 10 in (1, 2.5]: rank 0.99 * 100 = 99,
    # 9 into the 10 of (1, 2.5]: 1 + 1.5 * 9 / 10 = 2.35 s > 2 s.
    store = SeriesStore()
    rule = ttft_p99_above(2.0, window_s=60, for_s=20)
    evaluator = RuleEvaluator([rule], store)
    events = []
    for k in range(10):
        slow = 10 * k if k >= 3 else 0  # slow requests from t=30 on
        for le, count in (("0.1", 90 * k), ("1.0", 90 * k), ("2.5", 90 * k + slow),
                          ("+Inf", 90 * k + slow)):
            store.add("vllm:time_to_first_token_seconds_bucket",
                      {"le": le, "instance": "a"}, 10.0 * k, count)
        events += [(e.t_s, e.state, round(e.value, 2)) for e in evaluator.evaluate(10.0 * k)]
    # At t=30 the 60 s window (-30, 30] sees samples 0..30: slow ones only in the last step,
    # increases 270 up to 1 s and 280 in all (no extrapolation: the counters start at 0):
    # rank 0.99 * 280 = 277.2, 7.2 into the 10 of (1, 2.5]: 1 + 1.5 * 0.72 = 2.08 > 2 s.
    assert [e[:2] for e in events] == [(30, "pending"), (50, "firing")]
    assert rule.promql == ("histogram_quantile(0.99, sum by (le, instance) "
                           "(rate(vllm:time_to_first_token_seconds_bucket[60s]))) > 2")


def test_preemption_rate_and_error_ratio():
    store = SeriesStore()
    preempt = preemption_rate_above(0.5, window_s=30)
    errors = error_ratio_above(0.05, window_s=30)
    evaluator = RuleEvaluator([preempt, errors], store)
    for k in range(4):
        # 10 preemptions per 10 s: rate 1/s. 100 requests per 10 s, 10 of them 502s.
        store.add("vllm:num_preemptions_total", {"instance": "a"}, 10.0 * k, 10.0 * k)
        store.add("labkit_gateway_requests_total", {"backend": "b1", "status": "200"},
                  10.0 * k, 90.0 * k)
        store.add("labkit_gateway_requests_total", {"backend": "b1", "status": "502"},
                  10.0 * k, 10.0 * k)
        store.add("labkit_gateway_requests_total", {"backend": "b2", "status": "200"},
                  10.0 * k, 50.0 * k)
        evaluator.evaluate(10.0 * k)
    firing = {(a.rule, a.labels): a.value for a in evaluator.alerts(AlertState.FIRING)}
    # Window (0, 30]: 3 samples from 10 to 30, counter zero at t=0: increase 30, rate 1.
    assert firing[("VllmPreempting", (("instance", "a"),))] == pytest.approx(1.0)
    # 502s are 10 of every 100 on b1; b2 has no 5xx series, so no ratio at all.
    assert firing == {("VllmPreempting", (("instance", "a"),)): pytest.approx(1.0),
                      ("HighErrorRatio", (("backend", "b1"),)): pytest.approx(0.1)}


def test_no_traffic_is_nan_and_never_alerts():
    store = SeriesStore()
    evaluator = RuleEvaluator([error_ratio_above(0.0, window_s=30)], store)
    for k in range(3):
        store.add("labkit_gateway_requests_total", {"backend": "b", "status": "503"}, k, 0.0)
        assert evaluator.evaluate(float(k)) == []


def test_bad_rules_and_times_raise():
    with pytest.raises(ParameterError) as error:
        waiting_queue_above(4, for_s=-1)
    assert error.value.param == "for_s"
    with pytest.raises(ParameterError) as error:
        kv_usage_above(1.5)
    assert error.value.param == "fraction"
    with pytest.raises(ParameterError) as error:
        ttft_p99_above(1.0, window_s=0.0005)
    assert error.value.param == "window_s"
    with pytest.raises(ParameterError):
        RuleEvaluator([backend_down(), backend_down()], SeriesStore())
    evaluator = RuleEvaluator([backend_down()], SeriesStore())
    evaluator.evaluate(10)
    with pytest.raises(ParameterError) as error:
        evaluator.evaluate(10)
    assert error.value.param == "at_s"
