"""Byte units. The course never mixes decimal and binary silently (chapter 1,
:ref:`ch01-tutorial-wrong`).

``GB`` is 10**9 bytes, the unit of bandwidth figures (GB/s) and of marketing sizes;
``GiB`` is 2**30 bytes, the unit GPU memory is built and reported in.

Durations: :func:`prometheus_duration` writes seconds the way Prometheus reads them.
"""

import math

from labkit.checks import ParameterError, in_range

GB = 10**9
GiB = 2**30
MiB = 2**20


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for integers: e.g. blocks needed for ``a`` tokens of ``b`` each.

    vLLM calls it ``cdiv`` too. ``-(-a // b)`` stays exact for any size, where
    ``math.ceil(a / b)`` would round through a float.
    """
    return -(-a // b)


def ceil_tolerant(x: float, digits: int = 9) -> int:
    """Ceiling of a float that carries rounding noise: ``x`` is first rounded to ``digits``
    decimals, so a ratio that is whole on paper stays whole (every chapter that sizes
    something in whole units: replicas, probes, ``gpu_memory_utilization`` steps).

    ``0.07 * 100`` is ``7.000000000000001`` and ``1.1 * 3`` is ``3.3000000000000003`` in
    floating point; ``math.ceil(0.07 * 100)`` gives 8, this gives 7. Noise below
    ``10**-digits`` is ignored, so keep ``digits`` below the precision the inputs really have.
    Integers take :func:`cdiv`, which is exact.
    """
    return math.ceil(round(x, digits))


def prometheus_duration(seconds: float, param: str = "seconds") -> str:
    """``seconds`` as a Prometheus duration, the syntax of a scrape interval, a rule's
    ``for:`` and a range selector's ``[window]`` (chapter 8, :ref:`ch08-scraping`):
    ``30s``, ``90s``, ``1500ms``; 0 as ``0s``.

    Prometheus reads whole numbers of a unit (``ms``, ``s``, ``m``, ``h``, ... and their
    concatenations: ``1m30s`` is ``90s``; ``model.ParseDuration``, prometheus/common
    ``model/time.go``); labkit writes whole seconds, or milliseconds below them,
    so one interval always reads the same. A negative value, or one that is not a whole
    number of milliseconds (beyond float noise), raises
    :class:`~labkit.checks.ParameterError` naming ``param``, the caller's parameter.
    """
    in_range(param, seconds, 0)
    ms = round(seconds * 1000)
    if abs(ms - seconds * 1000) > 1e-6:
        raise ParameterError(param, f"{param} must be a whole number of milliseconds, "
                                    f"got {seconds!r}")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
