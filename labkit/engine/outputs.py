"""What ``generate`` returns, shaped like vLLM's ``RequestOutput`` (chapter 2.1)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence: its text so far, token ids, and why it stopped."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
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
    """A request's prompt, its output so far, and whether it has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step
