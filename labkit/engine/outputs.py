"""What ``generate`` returns, shaped like vLLM's ``RequestOutput`` (:ref:`ch02-offline-api`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position, as vLLM's ``Logprob``."""

    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    """One generated sequence (one of ``n`` choices): its text so far, tokens, why it stopped.

    While the request runs, ``text`` holds what may be streamed: an incomplete character or
    the possible beginning of a stop string waits for the next token. Each output extends
    the previous one, so a stream that sends the new part of ``text`` adds up to the final
    text. ``logprobs`` has one entry per token in ``token_ids`` when they were asked for.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps in seconds (``time.monotonic``), as vLLM's ``RequestOutput.metrics``."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's prompt, its ``n`` outputs so far, and whether all have finished.

    ``error`` is set when the request failed during a step (for example a constraint that no
    token can continue): it finished alone, the engine and every other request carry on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None  # None where the engine keeps none (vLLM v1's offline LLM)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: Exception | None = field(default=None, repr=False)
