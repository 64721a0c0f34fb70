"""Feedback for lab exercises: a check says whether an answer is right and, if not, what is off.

A wrong answer is compared with the values that common mistakes produce (a chapter's
``mistakes`` table) and with unit slips (GB for GiB, a factor of 1024), so a student reads
"you used the attention heads, not the KV heads" rather than just "wrong".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

_UNIT_SLIPS = {
    "used GB (1e9 bytes) where GiB (2**30 bytes) was asked": 2**30 / 1e9,
    "used GiB (2**30 bytes) where GB (1e9 bytes) was asked": 1e9 / 2**30,
    "are off by a factor of 1024 (bytes vs KiB, or MiB vs GiB)": 1024.0,
    "are off by a factor of 1/1024 (KiB vs bytes, or GiB vs MiB)": 1 / 1024,
    "are off by a factor of 1000 (ms vs s?)": 1000.0,
    "are off by a factor of 1/1000 (s vs ms?)": 1 / 1000,
}


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer. Truthy when correct; its repr is the message."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return self.message

    __str__ = __repr__


def check_number(answer: object, expected: float, *, what: str, unit: str = "",
                 rel_tol: float = 0.01, mistakes: Mapping[str, float] | None = None) -> Feedback:
    """Grade a numeric ``answer`` against ``expected`` within ``rel_tol``.

    ``mistakes`` maps a description ("used the attention heads") to the value that mistake
    gives; an answer matching one is told which. The expected value is not revealed.
    """
    if answer is None:
        return Feedback(False, f"Not answered yet: compute {what}.")
    if isinstance(answer, bool) or not isinstance(answer, Real) or not math.isfinite(answer):
        return Feedback(False, f"{what}: expected a finite number, got {answer!r}.")
    answer = float(answer)
    if math.isclose(answer, expected, rel_tol=rel_tol):
        return Feedback(True, f"Correct: {what} = {answer:,.6g} {unit}".rstrip() + ".")
    for description, value in (mistakes or {}).items():
        if math.isclose(answer, value, rel_tol=rel_tol):
            return Feedback(False,
                            f"Not quite: {answer:,.6g} is what you get if you {description}.")
    if expected:
        ratio = answer / expected
        for description, factor in _UNIT_SLIPS.items():
            if math.isclose(ratio, factor, rel_tol=rel_tol):
                return Feedback(False, f"Close, but you {description}.")
        return Feedback(False, f"Not quite: your {what} is {ratio:.3g}x the expected value.")
    return Feedback(False, f"Not quite: {what} should be 0.")
