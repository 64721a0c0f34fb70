"""Byte units. The course never mixes decimal and binary silently (chapter 1,
:ref:`ch01-tutorial-wrong`).

``GB`` is 10**9 bytes, the unit of bandwidth figures (GB/s) and of marketing sizes;
``GiB`` is 2**30 bytes, the unit GPU memory is built and reported in.
"""

GB = 10**9
GiB = 2**30
MiB = 2**20


def to_gib(num_bytes: float) -> float:
    """Bytes to GiB (2**30 bytes)."""
    return num_bytes / GiB


def to_gb(num_bytes: float) -> float:
    """Bytes to GB (10**9 bytes)."""
    return num_bytes / GB


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for integers: e.g. blocks needed for ``a`` tokens of ``b`` each.

    vLLM calls it ``cdiv`` too. ``-(-a // b)`` stays exact for any size, where
    ``math.ceil(a / b)`` would round through a float.
    """
    return -(-a // b)
