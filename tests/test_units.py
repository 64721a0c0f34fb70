"""Units and the two ceilings: exact for integers, tolerant of float noise for ratios."""

import math

from hypothesis import given
from hypothesis import strategies as st

from labkit.units import cdiv, ceil_tolerant


def test_float_noise_does_not_add_a_unit():
    assert math.ceil(0.07 * 100) == 8 and ceil_tolerant(0.07 * 100) == 7
    assert math.ceil(0.1 * 3 / 0.1) == 4 and ceil_tolerant(0.1 * 3 / 0.1) == 3
    assert ceil_tolerant(0.57 / 0.01) == 57
    assert ceil_tolerant(2.000001) == 3           # real fractions still round up
    assert ceil_tolerant(2.000001, digits=3) == 2  # unless asked to ignore them
    assert ceil_tolerant(-0.5) == 0


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_both_ceilings_agree_with_exact_division(a, b):
    assert cdiv(a, b) == ceil_tolerant(a / b) == -(-a // b)
