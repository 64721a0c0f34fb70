"""Regex-constrained decoding: SGLang's ``regex=`` and vLLM's structured outputs
(:ref:`ch02-sglang-frontend`).

Before each token is sampled, every token of the vocabulary whose text would take the output
outside the language of the pattern is masked to probability zero: the output so far plus the
token must still be a prefix of some match (``regex``'s partial matching answers exactly
that). End-of-sequence is allowed once the output is a full match.
:mod:`labkit.engine.structured` turns JSON schemas, choices and JSON objects into such a pattern.

Engines compile the pattern to an automaton over tokens to do this fast (xgrammar, outlines).
Here every token is checked directly, which is exact but costs one match per token per step,
each rescanning the output so far. One shortcut keeps it exact and cuts most of that work: a
token can only continue the output if its first character can, so tokens are grouped by first
character and a group whose character fails is ruled out by that one test.

The mask assumes that a token adds its own text to the output, whatever comes before it. That
holds for a byte-level BPE token made of whole characters, but not for one that holds part of
a multi-byte UTF-8 character: alone it decodes to U+FFFD, and what it adds depends on its
neighbours. Such tokens are never allowed, so the output can only use characters that some
token holds whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import regex

from labkit.checks import ParameterError

REPLACEMENT_CHARACTER = "\ufffd"
# The ``regex`` module unrolls counted repeats when it compiles: ``(a{1000}){1000}`` takes
# 300 MB and ``a{100000000}`` more memory than the machine has. A server compiles a client's
# pattern only after bounding that size.
MAX_EXPANDED_SIZE = 100_000
# A pattern that backtracks catastrophically, like ``(a|aa)*c``, takes time exponential in the
# output's length to rule out a character: past 40 characters, hours. The engine loop is shared
# by every request, so one mask may take at most this long; past it, the request fails alone
# (all its choices: they share the constraint, which then refuses at once).
MASK_TIMEOUT_S = 5.0
_REPEAT = regex.compile(r"\{(\d*),?(\d*)\}")


def expanded_size(pattern: str) -> int:
    """About how many elements ``pattern`` unrolls to: each literal, escape or character
    class counts one, a group the sum of its parts, and ``{m,n}`` multiplies what it repeats
    by its larger bound. An upper estimate, read from the text before compiling it."""
    totals = [0]  # the size of each open group, innermost last
    atom = 0      # the size of the last thing read: what a repeat would multiply
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "(":
            totals.append(0)
            atom, i = 0, i + 1
            continue
        if char == ")" and len(totals) > 1:
            atom = totals.pop()
            totals[-1] += atom
            i += 1
            continue
        repeat = _REPEAT.match(pattern, i) if char == "{" else None
        if repeat and any(repeat.groups()):
            times = max(int(n) for n in repeat.groups() if n)
            totals[-1] += atom * (times - 1)  # the atom itself is counted already
            atom, i = atom * times, repeat.end()
            continue
        if char == "\\":
            i += 2
        elif char == "[":  # a class is one element whatever it lists; "[]...]" has a "]"
            close = pattern.find("]", i + 2 if pattern.startswith("[]", i) else i + 1)
            i = len(pattern) if close == -1 else close + 1
        else:
            i += 1
        atom = 1
        totals[-1] += 1
    return sum(totals)


def compile_bounded(pattern: str) -> regex.Pattern:
    """``pattern`` compiled, once :func:`expanded_size` shows that compiling it is safe:
    every compile of a client's pattern goes through here."""
    size = expanded_size(pattern)
    if size > MAX_EXPANDED_SIZE:
        raise ParameterError("regex", f"regex: the pattern expands to about {size} "
                                      f"elements, more than the {MAX_EXPANDED_SIZE} this "
                                      f"server compiles (nested counted repeats multiply)")
    try:
        return regex.compile(pattern)
    except regex.error as err:
        raise ParameterError("regex", f"regex: invalid pattern: {err}") from None
    except RecursionError:  # the compiler recurses per group: "(" * 1000 is too deep
        raise ParameterError("regex", "regex: the pattern nests its groups too deeply") from None


class RegexConstraint:
    """Which tokens may come next so that the output can still match ``pattern``."""

    def __init__(self, pattern: str, token_texts: Sequence[str], eos_token_id: int | None):
        self.pattern = compile_bounded(pattern)
        self.token_texts = token_texts
        self.eos_token_id = eos_token_id
        self.too_slow = False  # a mask ran out of time: this pattern is given up on
        self._by_first_char: dict[str, list[int]] = {}
        for token_id, piece in enumerate(token_texts):
            if piece and REPLACEMENT_CHARACTER not in piece:
                self._by_first_char.setdefault(piece[0], []).append(token_id)

    def allowed(self, text: str) -> np.ndarray:
        """Boolean mask over the vocabulary for the token after ``text``; a
        :class:`~labkit.checks.ParameterError` if that takes over ``MASK_TIMEOUT_S``."""
        deadline = time.monotonic() + MASK_TIMEOUT_S
        mask = np.zeros(len(self.token_texts), dtype=bool)
        for first, token_ids in self._by_first_char.items():
            if self._matches(text + first, deadline):
                for token_id in token_ids:
                    piece = self.token_texts[token_id]
                    mask[token_id] = len(piece) == 1 or self._matches(text + piece, deadline)
        if self.eos_token_id is not None and self._matches(text, deadline, partial=False):
            mask[self.eos_token_id] = True
        return mask

    def is_full_match(self, text: str) -> bool:
        """Whether ``text`` matches the whole pattern (within ``MASK_TIMEOUT_S``)."""
        return self._matches(text, time.monotonic() + MASK_TIMEOUT_S, partial=False)

    def _matches(self, text: str, deadline: float, partial: bool = True) -> bool:
        """Whether ``text`` is a match or (``partial``) the start of one."""
        left_s = deadline - time.monotonic()
        try:
            if self.too_slow or left_s <= 0:  # the regex module reads 0 s as "no time left"
                raise TimeoutError
            return self.pattern.fullmatch(text, partial=partial, timeout=left_s) is not None
        except TimeoutError:
            self.too_slow = True
            raise ParameterError("regex", f"regex: matching the output took over "
                                          f"{MASK_TIMEOUT_S:g} s; the pattern backtracks "
                                          f"too much (nested or overlapping repeats, such as "
                                          f"(a|aa)*)") from None
