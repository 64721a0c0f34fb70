"""The autoscaling simulation: traces, and invariants of a fleet under a policy (chapter 5)."""

import numpy as np
import pytest

from labkit.autoscale import (COLD_START_S, GPU_UTILIZATION, RUNNING, WAITING, FleetConfig,
                              HorizontalPodAutoscaler, KedaAutoscaler, KnativePodAutoscaler,
                              ThresholdPolicy, ThresholdRule, bursty_trace,
                              compare_policies, comparison_table, diurnal_trace,
                              simulate_autoscaling, step_trace, trace_from_rate)
from labkit.checks import ParameterError
from labkit.simulate import Workload

SHORT = dict(input_len=256, output_len=32)  # short requests keep the runs fast


class Fixed:
    """A policy that always asks for ``n`` replicas; it records what it saw."""

    def __init__(self, n, name="fixed", sync_period_s=15.0):
        self.n, self.name, self.sync_period_s = n, name, sync_period_s
        self.seen = []

    def decide(self, observation, now):
        self.seen.append((now, observation))
        return self.n


def check_invariants(result, fleet):
    trace = result.trace
    # No request lost: every one routed, served and finished, in order.
    assert np.all(result.served_by >= 0)
    assert np.all(np.isfinite(result.finish_s))
    assert np.all(result.routed_s >= trace.arrival_s)
    assert np.all(result.first_token_s > result.routed_s)
    assert np.all(result.finish_s >= result.first_token_s)
    # Cold start respected: a replica is ready cold_start_s after it was asked for (the
    # initial ones at 0), and serves nothing before.
    ready = {r.index: r.ready_s for r in result.replicas}
    for r in result.replicas:
        if r.ready_s is not None and r.created_s > 0:
            assert r.ready_s == pytest.approx(r.created_s + fleet.cold_start_s)
    ready_at = np.array([ready[i] for i in result.served_by])
    assert np.all(result.routed_s >= ready_at)
    assert sum(r.served for r in result.replicas) == len(trace)
    # After every decision the fleet has exactly the replicas asked for.
    timeline = result.timeline
    assert np.array_equal(timeline.ready + timeline.starting, timeline.desired)


@pytest.fixture(scope="module")
def step_load():
    return step_trace([(120, 2.0), (240, 30.0), (120, 2.0)], seed=3, **SHORT)


@pytest.fixture(scope="module")
def fleet():
    return FleetConfig()


def test_cold_start_default_is_the_cited_figure(fleet):
    assert COLD_START_S == 18 + 10 + 13 + 7 + 34 == fleet.cold_start_s


# --- traces -------------------------------------------------------------------------------------

def test_traces_are_seeded_sorted_and_within_bounds():
    a = diurnal_trace(600, 10, 2, seed=7, input_len=100, output_len=50, range_ratio=0.2)
    b = diurnal_trace(600, 10, 2, seed=7, input_len=100, output_len=50, range_ratio=0.2)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s[-1] < 600
    assert a.prompt_lens.min() >= 80 and a.prompt_lens.max() <= 120
    assert a.output_lens.min() >= 40 and a.output_lens.max() <= 60
    fixed = diurnal_trace(600, 10, 2, seed=7)
    assert set(fixed.prompt_lens) == {1024} and set(fixed.output_lens) == {128}


def poisson_close(count, expected):
    return abs(count - expected) < 5 * np.sqrt(expected)


def test_diurnal_trace_follows_its_cosine():
    # Mean rate (peak + trough) / 2; trough at t = 0, peak half-way.
    trace = diurnal_trace(3600, 20.0, 2.0, seed=1)
    assert poisson_close(len(trace), 3600 * 11.0)
    t, rate = trace.rate(bin_s=360.0)
    assert rate.argmax() in (4, 5) and rate[0] < rate[5] / 3


def test_bursty_trace_bursts():
    trace = bursty_trace(600, 1.0, 20.0, burst_every_s=120, burst_s=20, seed=2)
    in_burst = (trace.arrival_s >= 100) & (np.mod(trace.arrival_s - 100, 120) < 20)
    assert poisson_close(in_burst.sum(), 5 * 20 * 20.0)     # bursts at 100, 220, ..., 580
    assert poisson_close((~in_burst).sum(), 500 * 1.0)


def test_step_trace_and_rate_checks():
    trace = step_trace([(100, 1.0), (100, 10.0)], seed=4)
    assert trace.duration_s == 200
    assert poisson_close((trace.arrival_s < 100).sum(), 100)
    assert poisson_close((trace.arrival_s >= 100).sum(), 1000)
    with pytest.raises(ParameterError, match="rate"):
        trace_from_rate(lambda t: np.full_like(t, 5.0), 4.0, 10.0)
    with pytest.raises(ParameterError, match="arrival_s"):
        Workload([2.0, 1.0], [1, 1], [1, 1], 10.0)


# --- the fleet ----------------------------------------------------------------------------------

def test_hpa_on_running_requests(step_load, fleet):
    hpa = HorizontalPodAutoscaler(RUNNING, 16, min_replicas=1, max_replicas=4)
    result = simulate_autoscaling(step_load, hpa, fleet)
    check_invariants(result, fleet)
    assert np.all((result.timeline.desired >= 1) & (result.timeline.desired <= 4))
    # It scales up once the step lands, and down only after the 300 s window.
    assert result.timeline.desired.max() > 1
    assert result.p99_ttft_ms() < 1000
    assert result.slo_attainment(1000) == 1.0


def test_scale_from_zero_waits_for_a_cold_start(step_load, fleet):
    result = simulate_autoscaling(step_load, KnativePodAutoscaler(container_concurrency_target=16),
                                  fleet, initial_replicas=0)
    check_invariants(result, fleet)
    first_ready = min(r.ready_s for r in result.replicas if r.ready_s is not None)
    assert first_ready >= fleet.cold_start_s
    early = step_load.arrival_s < first_ready
    # Requests that came before any replica was ready waited at the gateway for it.
    assert np.all(result.routed_s[early] >= first_ready)
    assert np.all(result.ttft_ms[early] >= 1e3 * (first_ready - step_load.arrival_s[early]))
    # The KPA asked for more replicas than it kept: those still starting were cancelled.
    assert any(r.ready_s is None for r in result.replicas)


def test_scale_to_zero_and_back(fleet):
    trace = step_trace([(60, 2.0), (400, 0.0), (60, 2.0)], seed=5, **SHORT)
    result = simulate_autoscaling(trace, KnativePodAutoscaler(container_concurrency_target=16),
                                  fleet)
    check_invariants(result, fleet)
    timeline = result.timeline
    zero = timeline.time_s[timeline.desired == 0]
    # The last request of the first minute ends just after 60 s: the stable average (60 s)
    # falls to 0 by ~122 s, the revision is marked inactive, and 30 s of grace later: zero.
    assert 150 <= zero.min() <= 154 and zero.max() <= 462
    assert timeline.desired[(timeline.time_s > 462) & (timeline.time_s <= 520)].min() == 1
    # The first request after the gap found no replica: its TTFT holds a whole cold start.
    late = np.flatnonzero(trace.arrival_s >= 460)[0]
    assert result.ttft_ms[late] >= 1e3 * fleet.cold_start_s - 2000  # KPA ticks every 2 s


def test_keda_scales_from_zero_on_the_gateway_queue(fleet):
    trace = step_trace([(200, 4.0)], seed=6, **SHORT)
    result = simulate_autoscaling(trace, KedaAutoscaler(5, max_replica_count=3), fleet,
                                  initial_replicas=0)
    check_invariants(result, fleet)
    assert result.timeline.desired[0] == 0 and result.timeline.desired.max() >= 1


def test_gpu_utilization_saturates_before_the_queue_does(fleet):
    # 6 requests/s of 256 + 128 tokens on one replica: it is never idle, so DCGM's duty
    # cycle reads ~100 %, yet nothing waits and TTFT stays small.
    trace = step_trace([(300, 6.0)], seed=8, input_len=256, output_len=128)
    seen = Fixed(1)
    result = simulate_autoscaling(trace, seen, fleet)
    metrics = [o.pods[0].metrics for t, o in seen.seen if 60 <= t <= 280]
    assert min(m[GPU_UTILIZATION] for m in metrics) > 95
    assert max(m[WAITING] for m in metrics) == 0
    assert result.p99_ttft_ms() < 500
    # So the tutorial's rule buys replicas for nothing, while HPA on the queue stays at 1.
    threshold = simulate_autoscaling(trace, ThresholdPolicy(ThresholdRule(1, 4)), fleet)
    hpa = simulate_autoscaling(trace, HorizontalPodAutoscaler(WAITING, 5, max_replicas=4), fleet)
    assert threshold.timeline.desired.max() > 1 == hpa.timeline.desired.max()
    assert threshold.replica_hours > hpa.replica_hours


def test_replica_hours_bill_the_cold_start(fleet):
    trace = step_trace([(200, 1.0)], seed=9, **SHORT)
    result = simulate_autoscaling(trace, Fixed(3), fleet)
    check_invariants(result, fleet)
    # One replica from 0, two more asked for at 0 and ready at 82 s, all up to the end.
    assert 200 <= result.end_s < 201
    assert result.replica_seconds == pytest.approx(3 * result.end_s)
    assert sorted(r.ready_s for r in result.replicas) == [0.0, fleet.cold_start_s,
                                                           fleet.cold_start_s]
    assert np.all(result.routed_s[result.served_by > 0] >= fleet.cold_start_s)


def test_round_robin_spreads_evenly(fleet):
    trace = step_trace([(100, 3.0)], seed=10, **SHORT)
    rr = FleetConfig(routing="round_robin")
    result = simulate_autoscaling(trace, Fixed(3), rr, initial_replicas=3)
    served = [r.served for r in result.replicas]
    assert max(served) - min(served) <= 1


def test_deterministic_and_compared_side_by_side(fleet):
    trace = step_trace([(100, 3.0)], seed=11, **SHORT)
    first, second = compare_policies(trace, [Fixed(1, "one"), Fixed(2, "two")], fleet)
    again = simulate_autoscaling(trace, Fixed(1, "one"), fleet)
    assert np.array_equal(first.first_token_s, again.first_token_s)
    table = comparison_table([first, second], ttft_slo_ms=1000)
    assert table.splitlines()[2].startswith("one") and table.splitlines()[3].startswith("two")
    assert second.replica_hours > first.replica_hours
    with pytest.raises(ParameterError, match="distinct"):
        compare_policies(trace, [Fixed(1), Fixed(2)], fleet)


def test_bad_policies_and_traces_are_refused(fleet):
    trace = step_trace([(20, 1.0)], seed=12, **SHORT)
    with pytest.raises(RuntimeError, match="unserved"):
        simulate_autoscaling(trace, Fixed(0), fleet, initial_replicas=0, overrun_s=60)
    with pytest.raises(ParameterError, match="replicas from policy"):
        simulate_autoscaling(trace, Fixed(-1), fleet)
    long = Workload([0.0], [8000], [500], 10.0)
    with pytest.raises(ParameterError) as err:
        simulate_autoscaling(long, Fixed(1), fleet)
    assert err.value.param == "trace"
    with pytest.raises(ParameterError) as err:
        FleetConfig(routing="random")
    assert err.value.param == "routing"
