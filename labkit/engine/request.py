"""One generation request as the teaching engine keeps it: a single record
(:doc:`chapter 2 </chapters/ch02_engines>`).

:class:`EngineRequest` is the scheduler's :class:`~labkit.scheduling.Request` (tokens, KV
progress, timestamps) plus what sampling and output need: the parameters, a random
generator, the incremental detokenizer, the constraint, the logprobs. Its ``check_stop`` is
the one place that decides a request is finished, in vLLM's order: length first (``max_tokens``
or the context window), then, once ``min_tokens`` are out, end-of-sequence, stop token ids,
and stop strings. The scheduler calls it after every appended token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.checks import ParameterError
from labkit.engine.constraints import RegexConstraint
from labkit.engine.detokenizer import IncrementalDetokenizer
from labkit.engine.outputs import CompletionOutput, Logprob, RequestMetrics
from labkit.engine.sampling import SamplingParams
from labkit.scheduling import Request


@dataclass(eq=False)
class EngineRequest(Request):
    """A request with its sampling state. ``index`` is its choice number among ``n``."""

    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    index: int = 0
    parent_id: str | None = None  # the request id the client knows (several choices share it)
    max_model_len: int = 2**31
    eos_token_id: int | None = None
    rng: np.random.Generator | None = field(default=None, repr=False)
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    constraint: RegexConstraint | None = field(default=None, repr=False)
    allowed: np.ndarray | None = field(default=None, repr=False)  # mask for the next token
    logprobs: list[dict[int, Logprob]] = field(default_factory=list, repr=False)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list, repr=False)
    constraint_param: str = "regex"  # the request field the constraint came from
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    error: Exception | None = field(default=None, repr=False)

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position: no cached prefix."""
        return self.params.prompt_logprobs is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def check_stop(self) -> bool:
        """Decide, after a new token, whether the request is done; detokenize that token."""
        token, params = self.token_ids[-1], self.params
        finish, reason = None, None
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
            finish = "length"
        elif self.num_output_tokens >= params.min_tokens:
            eos_ends = not params.ignore_eos or self.constraint is not None
            if token == self.eos_token_id and eos_ends:
                finish = "stop"
            elif token in params.stop_token_ids:
                finish, reason = "stop", token
        # The token that stopped the request is not part of the text, as in vLLM.
        if finish != "stop":
            # vLLM looks for stop strings only once more than min_tokens are out.
            stop = self.detokenizer.update(token, self.num_output_tokens > params.min_tokens)
            if stop is not None:
                finish, reason = "stop", stop
        if finish is None and self.constraint is not None:
            finish = self._next_mask()
        if finish is None:
            return False
        self.detokenizer.finish()
        self.finish_reason, self.stop_reason = finish, reason
        return True

    def _next_mask(self) -> str | None:
        """Mask the next token; a constrained output that nothing can continue ends here:
        as a stop when it is already a full match, else as this request's error (as does a
        pattern too slow to match, which must not stall the engine)."""
        text = self.detokenizer.text
        try:
            self.allowed = self.constraint.allowed(text)
            if self.allowed.any():
                return None
            if self.constraint.is_full_match(text):
                return "stop"
            problem = f"no token can continue the output {text!r}"
        except ParameterError as err:
            problem = str(err).removeprefix(f"{err.param}: ")
        self.error = ParameterError(self.constraint_param,
                                    f"{self.constraint_param}: {problem}")
        return "error"

    def sampling_mask(self, vocab_size: int) -> np.ndarray | None:
        """The tokens this request may sample next (``None``: any). Until ``min_tokens`` are
        out, its stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are masked
        too, as vLLM's min-tokens logits processor does: they cannot be sampled rather than
        sampled and ignored. A constraint that allows nothing else keeps its mask."""
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            return self.allowed
        stops = [t for t in params.stop_token_ids if 0 <= t < vocab_size]
        if not params.ignore_eos and self.eos_token_id is not None:
            stops.append(self.eos_token_id)
        if not stops:
            return self.allowed
        mask = np.ones(vocab_size, dtype=bool) if self.allowed is None else self.allowed.copy()
        mask[stops] = False
        return mask if mask.any() else self.allowed

    def completion(self) -> CompletionOutput:
        """This choice's output as the client sees it now: a snapshot, since a server's
        engine thread keeps appending to this request while the client's output is read."""
        return CompletionOutput(
            self.index, self.detokenizer.visible_text(), self.output_token_ids,
            self.finish_reason, self.stop_reason,
            list(self.logprobs) if self.params.logprobs is not None else None)

    def request_metrics(self) -> RequestMetrics:
        times = self.token_times
        return RequestMetrics(self.arrival_time, self.first_scheduled_time,
                              times[0] if times else None, times[-1] if times else None,
                              self.finish_time)
