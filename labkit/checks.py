"""Parameter checks with one wording everywhere, and the error type that names the parameter.

Every public function in labkit rejects bad input with a :class:`ParameterError`, a
``ValueError`` whose message starts with the parameter's name and says what is allowed, e.g.
``top_p must be in (0, 1], got 1.5``. The teaching engine's server (:mod:`labkit.engine.server`)
turns it into an HTTP 400 whose OpenAI error object carries ``param`` from the exception, never
guessed from the text.
"""

from __future__ import annotations

import math
import numbers


class ParameterError(ValueError):
    """A bad value for one named parameter (a ``ValueError``, so callers may catch either)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def positive_int(name: str, value, *, at_least: int = 1):
    """``value`` if it is an ``int`` >= ``at_least`` (a ``bool`` is not), else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < at_least:
        what = "a positive integer" if at_least == 1 else f"an integer >= {at_least}"
        raise ParameterError(name, f"{name} must be {what}, got {value!r}")
    return value


def in_range(name: str, value, low: float | None = None, high: float | None = None, *,
             low_open: bool = False, high_open: bool = False):
    """``value`` if it is a finite real number inside the interval, else raise.

    ``low``/``high`` of ``None`` leave that side unbounded; ``*_open`` excludes the end.
    The message writes the interval the mathematical way: ``(0, 1]``, ``[0, inf)``.
    """
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value)
          and (low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        interval = (("(" if low_open or low is None else "[")
                    + ("-inf" if low is None else f"{low:g}") + ", "
                    + ("inf" if high is None else f"{high:g}")
                    + (")" if high_open or high is None else "]"))
        raise ParameterError(name, f"{name} must be in {interval}, got {value!r}")
    return value
