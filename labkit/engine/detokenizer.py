"""Incremental detokenization with stop strings, as vLLM's output processor does it
(:doc:`chapter 2 </chapters/ch02_engines>`).

Decoding the whole output again after every token costs time that grows with the output, and
it streams garbage: a character whose UTF-8 bytes span two tokens decodes to U+FFFD until its
second token arrives, and a client that was already sent the U+FFFD never gets it corrected.
``tokenizers.decoders.DecodeStream`` keeps the undecoded bytes and returns text only once it
is complete, so the text only ever grows.

Stop strings need the same care. ``stop=["###"]`` must not stream ``"#"`` and ``"##"`` before
the third ``"#"`` shows it was a stop: text that could still become the start of a stop string
is held back until it cannot. With both rules, the concatenation of everything streamed equals
the final text, always.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """One request's output text, grown token by token, with its stop strings applied."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), *,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._hf = tokenizer.hf_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.finished = False

    def update(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string it completed, if any.

        ``check_stop=False`` (before ``min_tokens``) appends without looking. Only the end
        of the text is searched, for each stop string on its own: one that ends inside the
        new piece starts at most ``len(stop) - 1`` characters before it. (A wider window
        would find a short stop string written before ``min_tokens`` were out.)
        """
        piece = self._stream.step(self._hf, token_id)
        if not piece:
            return None
        if not check_stop:
            self.text += piece
            return None
        end = len(self.text)  # where the new piece starts
        self.text += piece
        found = [(cut, stop) for stop in self.stop
                 if (cut := self.text.find(stop, max(0, end - len(stop) + 1))) != -1]
        if not found:
            return None
        cut, stop = min(found)  # the earliest stop wins when one token completes two
        self.text = self.text[:cut + len(stop) if self.include_stop_str_in_output else cut]
        self.finished = True
        return stop

    def visible_text(self) -> str:
        """The text a client may be sent now: all of it once finished, else all but the
        longest tail that is the beginning of some stop string."""
        if self.finished or not self.stop:
            return self.text
        hold = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:n]):
                    hold = n
                    break
        return self.text[:len(self.text) - hold]

    def finish(self) -> None:
        """Release held-back text: the request ended for another reason (length, EOS)."""
        self.finished = True
