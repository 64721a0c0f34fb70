"""labkit.monitor.series (chapter 8): rate(), increase() and histogram_quantile() against
numbers worked out by hand from PromQL's rules (Prometheus v3.9.1, promql/functions.go
extrapolatedRate and promql/quantile.go BucketQuantile), and against the real Prometheus
(promtool) where it is installed."""

import math
import shutil
import subprocess

import pytest

from labkit.checks import ParameterError
from labkit.monitor.series import (Sample, Series, SeriesStore, bucket_quantile,
                                   extrapolated_delta, histogram_quantile, increase, rate)


def series(points) -> Series:
    return Series("c_total", (), [Sample(t, v) for t, v in points])


# -- rate() / increase() ------------------------------------------------------------------

RESET = [(10, 5), (20, 15), (30, 3), (40, 13), (50, 23), (60, 33)]


def test_increase_adds_back_a_counter_reset_and_stops_at_the_counters_zero():
    # Window (0, 60]. Raw 33 - 5 = 28, plus 15 lost at the reset (15 -> 3): 43.
    # Sampled 50 s, average interval 10 s, threshold 11 s. The start gap, 10 s, is under
    # it, but the counter was zero 50 * 5 / 43 = 5.81 s before its first sample: 5.81 s.
    # End gap 0. increase = 43 * (50 + 250/43) / 50 = (2150 + 250) / 50 = 48.
    assert increase(series(RESET), 60, 60) == pytest.approx(48)
    assert rate(series(RESET), 60, 60) == pytest.approx(48 / 60)


def test_extrapolation_to_far_edges_is_half_an_interval():
    # Window (0, 60], samples at 15, 25, 35: sampled 20 s, average 10 s, threshold 11 s.
    # Start gap 15 s and end gap 25 s are both past it: each becomes 10 / 2 = 5 s. The
    # counter's zero lies 20 * 100 / 20 = 100 s back, further than 5 s.
    # increase = 20 * (20 + 5 + 5) / 20 = 30; rate = 30 / 60 = 0.5.
    s = series([(15, 100), (25, 110), (35, 120)])
    assert increase(s, 60, 60) == pytest.approx(30)
    assert rate(s, 60, 60) == pytest.approx(0.5)


def test_extrapolation_to_near_edges_goes_all_the_way():
    # Window (0, 40], samples at 5..35: gaps 5 s and 5 s, under 11 s: both kept.
    # increase = 30 * (30 + 5 + 5) / 30 = 40.
    assert increase(series([(5, 100), (15, 110), (25, 120), (35, 130)]), 40, 40) == \
        pytest.approx(40)


def test_a_gauge_drop_is_not_a_reset():
    # delta(): -3 over 10 s, start gap 10 s (< 11) kept, end gap 0: -3 * 20 / 10 = -6.
    assert extrapolated_delta([Sample(10, 5), Sample(20, 2)], 0, 20, is_counter=False) == \
        pytest.approx(-6)


def test_the_window_is_left_open_and_needs_two_samples():
    s = series([(0, 0), (10, 10), (20, 20)])
    # (0, 20] holds t=10 and t=20 only: 10 * (10 + 10 + 0) / 10 = 20, the zero point
    # (10 * 10 / 10 = 10 s back) being no nearer than the start.
    assert increase(s, 20, 20) == pytest.approx(20)
    assert increase(s, 5, 20) is None
    with pytest.raises(ParameterError) as error:
        rate(s, 0, 20)
    assert error.value.param == "window_s"


# -- histogram_quantile() ------------------------------------------------------------------

BUCKETS = [(0.1, 10), (0.5, 30), (1.0, 40), (math.inf, 40)]


def test_quantile_interpolates_inside_a_bucket():
    # q=0.5: rank 20 falls in (0.1, 0.5], which holds 30 - 10 = 20; 10 of them below the
    # rank: 0.1 + 0.4 * 10 / 20 = 0.3.
    assert bucket_quantile(0.5, BUCKETS) == pytest.approx(0.3)
    # q=0.1: rank 4 in the lowest bucket, which starts at 0: 0.1 * 4 / 10 = 0.04.
    assert bucket_quantile(0.1, BUCKETS) == pytest.approx(0.04)
    # q=1: rank 40 reached in (0.5, 1]: 0.5 + 0.5 * 10 / 10 = 1.0. Order does not matter.
    assert bucket_quantile(1, reversed(BUCKETS)) == pytest.approx(1.0)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    # rank 0.9 * 40 = 36 > 30, the count up to 0.5: it lies in (0.5, +Inf]: 0.5.
    assert bucket_quantile(0.9, [(0.1, 10), (0.5, 30), (math.inf, 40)]) == 0.5


def test_quantile_edge_cases_are_pythons_nan_and_inf_like_promql():
    assert math.isnan(bucket_quantile(0.5, [(0.1, 0), (math.inf, 0)]))     # no observations
    assert math.isnan(bucket_quantile(0.5, [(0.1, 1), (1.0, 2)]))           # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(math.inf, 3)]))                # one bucket
    assert math.isnan(bucket_quantile(0.5, []))
    assert math.isnan(bucket_quantile(math.nan, BUCKETS))
    assert bucket_quantile(-0.1, BUCKETS) == -math.inf
    assert bucket_quantile(1.1, BUCKETS) == math.inf


def test_quantile_lowest_bucket_at_or_below_zero_returns_its_bound():
    # rank 0.2 * 10 = 2 in the lowest bucket, whose bound -1 is not positive: -1.
    assert bucket_quantile(0.2, [(-1, 5), (0, 10), (math.inf, 10)]) == -1


def test_quantile_coalesces_repeated_bounds_and_lifts_dips():
    # Two 0.1 buckets add up to 10; the 0.5 count 8 dips below 10 and is lifted to 10.
    # q=0.5: rank 10 is reached at 0.1: 0.1 * 10 / 10 = 0.1.
    assert bucket_quantile(0.5, [(0.1, 4), (0.1, 6), (0.5, 8), (1, 20), (math.inf, 20)]) \
        == pytest.approx(0.1)


def test_quantile_rejects_what_is_not_a_number():
    with pytest.raises(ParameterError) as error:
        bucket_quantile("0.5", BUCKETS)
    assert error.value.param == "q"
    with pytest.raises(ParameterError) as error:
        bucket_quantile(0.5, [("x", 1), (math.inf, 1)])
    assert error.value.param == "buckets"


def test_histogram_quantile_over_a_window_from_the_store():
    # Buckets growing 1 : 3 : 4 per 10 s: every rate has the same extrapolation factor, so
    # the rates keep those ratios: rank 0.5 * 4 = 2 in (0.1, 0.5]: 0.1 + 0.4 * 1 / 2 = 0.3.
    store = SeriesStore()
    for k in range(1, 7):
        for le, per in (("0.1", 1), ("0.5", 3), ("+Inf", 4)):
            store.add("ttft_bucket", {"le": le, "instance": "a"}, 10.0 * k, per * k)
    assert histogram_quantile(0.5, store, "ttft", 60, window_s=60) == \
        {(): pytest.approx(0.3)}
    assert histogram_quantile(0.5, store, "ttft", 60, by=("instance",)) == \
        {(("instance", "a"),): pytest.approx(0.3)}


def test_store_rejects_samples_out_of_order_and_drops_old_ones():
    store = SeriesStore(retention_s=15)
    store.add("g", {}, 10, 1)
    with pytest.raises(ParameterError) as error:
        store.add("g", {}, 10, 2)
    assert error.value.param == "t_s"
    store.add("g", {}, 20, 2)
    store.add("g", {}, 30, 3)
    assert [s.t_s for s in store.select("g")[0].samples] == [20, 30]
    with pytest.raises(ParameterError):
        SeriesStore(retention_s=0)


# -- the real Prometheus -------------------------------------------------------------------

PROMTOOL_TEST = """\
tests:
  - interval: 10s
    input_series:
      - series: 'c_total'
        values: '_ 5 15 3 13 23 33'
      - series: 'h_bucket{{le="0.1"}}'
        values: '0+1x6'
      - series: 'h_bucket{{le="0.5"}}'
        values: '0+3x6'
      - series: 'h_bucket{{le="+Inf"}}'
        values: '0+4x6'
    promql_expr_test:
      - expr: increase(c_total[1m])
        eval_time: 60s
        exp_samples:
          - labels: '{{}}'
            value: {increase}
      # Equal to our number within 1e-9: Prometheus' float rounding may differ in the last
      # bit (0.1 + 0.2 is 0.30000000000000004 in ours, 0.3 in Debian's 2.42).
      - expr: abs(histogram_quantile(0.5, rate(h_bucket[45s])) - {quantile}) < bool 1e-9
        eval_time: 60s
        exp_samples:
          - labels: '{{}}'
            value: 1
"""


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="Prometheus' promtool is not installed (Debian package "
                           "'prometheus'; the Makefile decides where it is installed)")
@pytest.mark.real_engine  # promtool
def test_prometheus_computes_the_same_numbers(tmp_path):
    store = SeriesStore()
    for k in range(7):
        for le, per in (("0.1", 1), ("0.5", 3), ("+Inf", 4)):
            store.add("h_bucket", {"le": le}, 10.0 * k, per * k)
    ours = histogram_quantile(0.5, store, "h", 60, window_s=45)[()]
    path = tmp_path / "test.yml"
    path.write_text(PROMTOOL_TEST.format(increase=repr(increase(series(RESET), 60, 60)),
                                         quantile=repr(ours)))
    run = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
