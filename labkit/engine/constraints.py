"""Regex-constrained decoding, the way SGLang's ``regex=`` works (chapter 2.3).

Before each token is sampled, every token of the vocabulary whose text would take the output
outside the language of the pattern is masked to probability zero: the output so far plus the
token must still be a prefix of some match (``regex``'s partial matching answers exactly
that). End-of-sequence is allowed once the output is a full match. Engines compile the pattern
to an automaton over tokens to do this fast (xgrammar, outlines); checking every token directly
is slow for a 128k-token vocabulary but exact, and fine for the teaching engine's 512 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import regex


class RegexConstraint:
    """Which tokens may come next so that the output can still match ``pattern``."""

    def __init__(self, pattern: str, token_texts: Sequence[str], eos_token_id: int | None):
        try:
            self.pattern = regex.compile(pattern)
        except regex.error as err:
            raise ValueError(f"regex: invalid pattern: {err}") from None
        self.token_texts = token_texts
        self.eos_token_id = eos_token_id

    def allowed(self, text: str) -> np.ndarray:
        """Boolean mask over the vocabulary for the token after ``text``."""
        mask = np.array([bool(piece) and self.pattern.fullmatch(text + piece, partial=True)
                         is not None for piece in self.token_texts])
        if self.eos_token_id is not None and self.pattern.fullmatch(text):
            mask[self.eos_token_id] = True
        return mask
