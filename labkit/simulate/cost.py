"""How long one engine step takes, for the simulator (chapter 3.3).

The default is chapter 1's roofline for a named model and GPU: a step costs its FLOPs at peak
or its bytes at peak bandwidth, whichever is larger, plus an optional fixed overhead per step
(scheduling, sampling, kernel launches: a real engine spends milliseconds here). Any callable
``rows -> seconds`` can stand in, for example a table measured on a real GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from labkit.checks import in_range
from labkit.hardware import get_gpu, get_model, step_bound


class StepCostModel(Protocol):
    def __call__(self, rows: Sequence[tuple[int, int]]) -> float:
        """Seconds for one step over ``(new_tokens, context_before)`` rows."""


@dataclass(frozen=True)
class RooflineCost:
    """Roofline step time of ``model`` on ``tensor_parallel_size`` x ``gpu``."""

    model: str
    gpu: str
    tensor_parallel_size: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        get_model(self.model)  # fail early on unknown names
        get_gpu(self.gpu)
        in_range("step_overhead_s", self.step_overhead_s, 0)

    def __call__(self, rows: Sequence[tuple[int, int]]) -> float:
        bound = step_bound(self.model, self.gpu, rows, self.weight_dtype, self.kv_dtype,
                           self.tensor_parallel_size)
        return bound.time_s + self.step_overhead_s
