"""Chapter 5 autoscaling exercise checks: right answers pass, the usual mistakes are named, and
the expected values are the ones worked out by hand from the documented algorithms."""

import pytest

from labkit.checks import ParameterError
from labkit.exercises import ch05_autoscaling as ex


def test_hpa_desired_replicas():
    # ratio 7 / 5 = 1.4, 3 * 1.4 = 4.2 -> ceil 5.
    assert ex.check_hpa_desired_replicas(5)
    assert "rounded down" in repr(ex.check_hpa_desired_replicas(4))
    assert "total" in repr(ex.check_hpa_desired_replicas(13))          # ceil(3 * 3 * 1.4)
    assert "current replica count" in repr(ex.check_hpa_desired_replicas(2))
    assert "Not answered" in repr(ex.check_hpa_desired_replicas(None))
    assert not ex.check_hpa_desired_replicas("5")
    # Other numbers: 4 replicas at 12 against 5: ceil(9.6) = 10.
    assert ex.check_hpa_desired_replicas(10, current=4, average=12, target=5)
    assert not ex.check_hpa_desired_replicas(9, current=4, average=12, target=5)


@pytest.mark.parametrize("average, expected", [
    (10.9, 10),    # ratio 1.09: inside the 10 % tolerance, nothing changes
    (11.0, 10),    # exactly 1.1: still inside (the bounds are inclusive)
    (11.1, 12),    # 1.11: ceil(11.1) = 12
    (8.9, 9),      # 0.89: below 0.9, ceil(8.9) = 9
])
def test_tolerance_edges(average, expected):
    assert ex.check_tolerance_replicas(expected, average=average)
    assert not ex.check_tolerance_replicas(expected + 1, average=average)


def test_tolerance_mistake_is_named():
    assert "tolerance" in repr(ex.check_tolerance_replicas(11))


def test_replicas_after_the_scale_down_window():
    # Recommendations: 8 until 60 s, 3 until 120 s, 5 at 120 s, 2 from 135 s. The highest
    # recommendation of the last 300 s holds the fleet: 8 (the one at 45 s) until 345 s, then
    # 5 (the one at 120 s) until 420 s, then 2.
    recs = ex.DEFAULT_RECOMMENDATIONS
    assert [ex.replicas_after(recs, t) for t in (0, 60, 330, 345, 405, 420)] == [8, 8, 8, 5, 5, 2]
    assert ex.check_replicas_after_window(5)
    assert "latest" in repr(ex.check_replicas_after_window(2))
    assert "highest recommendation ever" in repr(ex.check_replicas_after_window(8))
    assert "300 s before" in repr(ex.check_replicas_after_window(3))
    assert ex.check_replicas_after_window(2, at_s=420.0)
    with pytest.raises(ParameterError):
        ex.replicas_after([(10.0, 3)], 100.0)
    with pytest.raises(ParameterError):
        ex.replicas_after([(0.0, 3), (0.0, 2)], 100.0)


def test_panic_needs_twice_the_ready_pods_rounded_up():
    # Target 100 * 70 % = 70 per pod; 3 pods panic when ceil(c / 70) >= 6, i.e. c > 350.
    assert ex.smallest_panic_concurrency(3) == 351
    assert ex.panics(351) and not ex.panics(350)
    # One pod: ceil(c / 70) >= 2; four pods at a target of 10: ceil(c / 10) >= 8.
    assert ex.smallest_panic_concurrency(1) == 71
    assert ex.smallest_panic_concurrency(4, container_concurrency_target=10,
                                         target_utilization=1.0) == 71


@pytest.mark.parametrize("answer, phrase", [
    (420, "rounds the pods up"),
    (421, ">="),
    (501, "target utilization"),
    (71, "one pod"),
    (141, "200 %"),
])
def test_panic_mistakes_are_named(answer, phrase):
    feedback = ex.check_panic_concurrency(answer)
    assert not feedback and phrase in repr(feedback)


def test_panic_check_accepts_the_right_answer():
    assert ex.check_panic_concurrency(351)
    assert ex.check_panic_concurrency(71, ready_pods=1)
    assert "Not answered" in repr(ex.check_panic_concurrency(None))
