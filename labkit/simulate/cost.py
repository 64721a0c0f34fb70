"""How long one engine step takes, for the simulator (:ref:`ch03-simulating`).

The default is chapter 1's roofline for a named model and GPU: a step costs its FLOPs at peak
or its bytes at peak bandwidth, whichever is larger, plus an optional fixed overhead per step
(scheduling, sampling, kernel launches: a real engine spends milliseconds here). Any callable
``rows -> seconds`` can stand in, for example a table measured on a real GPU.

The roofline sees a step's rows only through three sums (:func:`row_totals`). A cost model
that says so with a ``time_of_totals`` method, equal to calling it on any rows with those sums,
lets the fast simulator charge a step of a thousand decodes in O(1), from running sums,
instead of building its rows (a subclass that changes ``__call__`` alone is charged by rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from labkit.checks import in_range
from labkit.hardware import ModelSpec, get_gpu, get_model, kv_cache_bytes_per_token, step_bound
from labkit.hardware.memory import check_tensor_parallel
from labkit.hardware.roofline import (_attention_flops, _compute_dtype, _matmul_flops_per_token,
                                      _weight_traffic)


class StepCostModel(Protocol):
    def __call__(self, rows: Sequence[tuple[int, int]]) -> float:
        """Seconds for one step over ``(new_tokens, context_before)`` rows."""


def row_totals(rows: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """``(tokens, attention pairs, KV tokens)`` of a step's rows, the sums ``step_bound`` takes.

    Row ``(n, c)`` computes ``n`` tokens, its new token ``j`` attends to ``c + j`` tokens
    (``n c + n (n + 1) / 2`` query-key pairs), and it reads and writes ``n + c`` tokens of KV.
    """
    return (sum(n for n, _ in rows), sum(n * c + n * (n + 1) // 2 for n, c in rows),
            sum(n + c for n, c in rows))


@dataclass(frozen=True)
class _RooflineTerms:
    """One model on one GPU: the roofline's constants, and its weight bytes per token count."""

    model: ModelSpec
    matmul_flops_per_token: int
    attention_flops_per_pair: int
    kv_bytes_per_token: int
    peak_ops_s: float
    bandwidth_bytes_s: float
    weight_bytes: dict[int, float]  # memo: tokens -> bytes (MoE reads more experts as it grows)


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
        check_tensor_parallel(get_model(self.model), self.tensor_parallel_size)  # fail early
        get_gpu(self.gpu)
        in_range("step_overhead_s", self.step_overhead_s, 0)

    def __call__(self, rows: Sequence[tuple[int, int]]) -> float:
        bound = step_bound(self.model, self.gpu, rows, self.weight_dtype, self.kv_dtype,
                           self.tensor_parallel_size)
        return bound.time_s + self.step_overhead_s

    def time_of_totals(self, num_tokens: int, num_pairs: int, num_kv_tokens: int) -> float:
        """The same time from the step's :func:`~labkit.simulate.cost.row_totals`, in O(1).

        Bit for bit what calling the model on the rows returns: the same float operations in
        the same order as ``step_bound`` (which sums the pairs as floats; below 2**53 that sum
        is exact, hence ``float(num_pairs)``). A test holds the two equal.
        """
        terms = self._terms
        weights = terms.weight_bytes.get(num_tokens)
        if weights is None:
            weights = _weight_traffic(terms.model, self.weight_dtype, num_tokens)
            terms.weight_bytes[num_tokens] = weights
        flops = (terms.matmul_flops_per_token * num_tokens
                 + terms.attention_flops_per_pair * float(num_pairs))
        bytes_moved = weights + terms.kv_bytes_per_token * num_kv_tokens
        tp = self.tensor_parallel_size
        compute_s = flops / tp / terms.peak_ops_s
        memory_s = bytes_moved / tp / terms.bandwidth_bytes_s
        return max(compute_s, memory_s) + self.step_overhead_s

    @cached_property
    def _terms(self) -> _RooflineTerms:
        model, gpu = get_model(self.model), get_gpu(self.gpu)
        return _RooflineTerms(model, _matmul_flops_per_token(model), _attention_flops(model, 1, 1),
                              kv_cache_bytes_per_token(model, self.kv_dtype),
                              gpu.peak_ops_s(_compute_dtype(self.weight_dtype)),
                              gpu.mem_bandwidth_bytes_s, {})
