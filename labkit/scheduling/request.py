"""A request as the scheduler sees it (chapter 3.2)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt, the tokens it will produce, and what happened to it, in seconds.

    A simulator knows the output in advance and passes it as ``output_plan``; an engine
    samples each token and passes ``max_tokens`` instead. ``num_computed_tokens`` counts tokens
    whose K and V are in the cache; preemption by recompute sets it back to zero.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    output_plan: Sequence[int] | None = None
    arrival_time: float = 0.0
    max_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    token_ids: list[int] = field(init=False)
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must have a token")
        if self.output_plan is not None:
            if self.max_tokens not in (None, len(self.output_plan)):
                raise ValueError(f"request {self.request_id!r}: max_tokens differs from the "
                                 f"length of output_plan")
            self.max_tokens = len(self.output_plan)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id!r}: arrival_time must be >= 0")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and every token produced."""
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def record_step(self, num_new_tokens: int, now: float, token_id: int | None = None) -> bool:
        """Account for ``num_new_tokens`` computed in a step ending at ``now``.

        Once every known token is computed the model emits the next one: ``token_id`` when an
        engine sampled it, else the next planned token. Returns True when that was the
        request's last token (``max_tokens`` reached), and marks the request finished.
        """
        self.num_computed_tokens += num_new_tokens
        if self.num_computed_tokens < self.num_tokens:
            return False  # a prefill chunk: no token sampled yet
        if token_id is None:
            if self.output_plan is None:
                raise ValueError(f"request {self.request_id!r} has no planned output: "
                                 f"pass the sampled token_id")
            token_id = self.output_plan[self.num_output_tokens]
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if self.num_output_tokens < self.max_tokens:
            return False
        self.finish(now)
        return True

    def finish(self, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_time = now
