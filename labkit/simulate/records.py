"""What a simulation returns (:ref:`ch03-simulating`): the requests, and a record of every step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from labkit.scheduling import Request
from labkit.simulate.metrics import BenchmarkResult, summarize


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did: when, how much, and the state of memory after it."""

    start_s: float
    end_s: float
    num_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int


@dataclass
class SimulationResult:
    """Finished requests and the step-by-step timeline of one run."""

    requests: list[Request]
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last token."""
        start = min(r.arrival_time for r in self.requests)
        return max(r.finish_time for r in self.requests) - start

    def summary(self, slos_ms: Mapping[str, float] | None = None) -> BenchmarkResult:
        return summarize(self.requests, self.duration_s, slos_ms)
