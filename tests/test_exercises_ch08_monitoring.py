"""Chapter 8 monitoring exercise checks: right answers pass, the usual mistakes are named, and
the expected values are the ones worked out by hand from PromQL's documented math and
Prometheus' rule evaluation."""

import pytest

from labkit.checks import ParameterError
from labkit.exercises import ch08_monitoring as ex


def test_p99_over_the_window():
    # Increase per bucket (after - before): le 0.1: 10, 0.25: 30, 0.5: 45, 1: 52, 2.5: 60,
    # +Inf: 60. Rank 0.99 * 60 = 59.4 falls in (1, 2.5] (52 < 59.4 <= 60):
    # 1 + 1.5 * (59.4 - 52) / (60 - 52) = 1 + 1.5 * 0.925 = 2.3875 s.
    assert ex.check_p99_over_window(2.3875)
    assert ex.check_p99_over_window(2.388)          # within 0.1 %
    # The cumulative counts: rank 99 in (1, 2.5]: 1 + 1.5 * (99 - 92) / 8 = 2.3125 s.
    assert "cumulative" in repr(ex.check_p99_over_window(2.3125))
    assert "upper bound" in repr(ex.check_p99_over_window(2.5))
    assert "lower bound" in repr(ex.check_p99_over_window(1.0))
    # Rank 0.01 * 60 = 0.6 in (0, 0.1]: 0.1 * 0.6 / 10 = 0.006 s.
    assert "p1" in repr(ex.check_p99_over_window(0.006))
    assert "Not answered" in repr(ex.check_p99_over_window(None))
    assert "ms vs s" in repr(ex.check_p99_over_window(2387.5))
    # The median: rank 30 in (0.1, 0.25]: 0.1 + 0.15 * (30 - 10) / 20 = 0.25 s.
    assert ex.check_p99_over_window(0.25, q=0.5)
    with pytest.raises(ParameterError):
        ex.check_p99_over_window(1.0, after={1.0: 5.0, float("inf"): 5.0})


@pytest.mark.parametrize("promql", [
    "vllm:num_requests_waiting > 5",
    "vllm:num_requests_waiting>5",
    'vllm:num_requests_waiting{job="vllm"} > 5',
    "sum by (instance) (vllm:num_requests_waiting) > 5",
    "vllm:num_requests_waiting > 5.0",
])
def test_queue_alert_right_answers(promql):
    assert ex.check_queue_alert_promql(promql), promql


@pytest.mark.parametrize("promql, named", [
    ("vllm:num_requests_waiting >= 5", ">= where > belongs"),
    ("sum(vllm:num_requests_waiting) > 5", "lost the instance label"),
    ("vllm:num_requests_waiting > 10", "flags no server"),
    ("rate(vllm:num_requests_waiting[1m]) > 5", "gauge"),
    ("vllm:gpu_cache_usage_perc > 0.9", "deprecated"),
    ("vllm_num_requests_waiting > 5", "no known metric"),
    ("max_over_time(vllm:num_requests_waiting[5m]) > 5", "PromQL shapes only"),
    ("vllm:num_requests_waiting[1m]", "range vector"),
    ("", "PromQL string"),
    (5, "PromQL string"),
    (None, "Not answered"),
])
def test_queue_alert_mistakes_are_named(promql, named):
    feedback = ex.check_queue_alert_promql(promql)
    assert not feedback
    assert named in repr(feedback), repr(feedback)


def test_alert_fire_time():
    # Queue up at 2 s. Scrapes at 0, 15, 30 ...: the one at 15 s first sees it. Evaluations
    # at 7, 22, 37, 52 ...: at 22 the condition holds, pending since 22; at 37, 15 s < 30 s;
    # at 52, 30 s >= 30 s: firing at 52 s.
    assert ex.alert_fire_time() == 52.0
    assert ex.check_alert_fire_time(52)
    assert "moment the queue rose" in repr(ex.check_alert_fire_time(32))
    assert "from the scrape" in repr(ex.check_alert_fire_time(45))
    assert "before any scrape" in repr(ex.check_alert_fire_time(37))
    assert "one evaluation too many" in repr(ex.check_alert_fire_time(67))
    # Scrapes and evaluations every second, both at whole seconds: the scrape at 2 s sees
    # the queue, the evaluation at 2 s (after it) finds it, firing at 2 + 30 = 32 s.
    assert ex.alert_fire_time(scrape_interval_s=1, evaluation_interval_s=1,
                              evaluation_offset_s=0) == 32.0
    # for: 0 fires at the first evaluation that sees the queue: 22 s.
    assert ex.alert_fire_time(for_s=0) == 22.0
    with pytest.raises(ParameterError):
        ex.alert_fire_time(scrape_interval_s=0)
