"""Serving metrics with ``vllm bench serve``'s names and definitions (:ref:`ch03-simulating`).

- TTFT: arrival to first output token. TPOT: the rest of the request's time divided by the
  rest of its tokens. ITL: every gap between consecutive tokens. E2EL: arrival to last token.
- Goodput: completed requests per second that meet every given SLO (ms), as in vLLM's
  ``--goodput ttft:500 tpot:50``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from labkit.checks import ParameterError, in_range
from labkit.scheduling import Request

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestLatencies:
    """One finished request's latencies, in milliseconds, as ``vllm bench serve`` counts them.

    Not the engine's per-request timestamps: those are vLLM's ``RequestMetrics``
    (:class:`labkit.engine.outputs.RequestMetrics`).
    """

    request_id: str
    prompt_len: int
    output_len: int
    ttft_ms: float
    tpot_ms: float
    e2el_ms: float
    itl_ms: tuple[float, ...]

    @classmethod
    def of(cls, request: Request) -> RequestLatencies:
        if request.finish_time is None:
            raise ParameterError("request", f"request {request.request_id!r} has not finished")
        return cls.from_times(request.request_id, request.prompt_len, request.arrival_time,
                              request.token_times)

    @classmethod
    def from_times(cls, request_id: str, prompt_len: int, start_s: float,
                   token_times_s: Sequence[float]) -> RequestLatencies:
        """Latencies from a start time and the arrival time of every output token."""
        times = np.asarray(token_times_s)
        if times.size == 0:
            raise ParameterError("token_times_s", f"token_times_s: request {request_id!r} "
                                                  f"produced no token")
        ttft = times[0] - start_s
        e2el = times[-1] - start_s
        n = len(times)
        return cls(request_id, prompt_len, n, 1e3 * ttft,
                   1e3 * (e2el - ttft) / (n - 1) if n > 1 else 0.0, 1e3 * e2el,
                   tuple(1e3 * np.diff(times)))


@dataclass(frozen=True)
class BenchmarkResult:
    """The summary ``vllm bench serve`` prints, from simulated or measured requests."""

    completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    p99_e2el_ms: float

    def table(self) -> str:
        """A plain-text report in the order vLLM prints it."""
        lines = [f"{'Successful requests:':<40}{self.completed:>12}",
                 f"{'Benchmark duration (s):':<40}{self.duration_s:>12.2f}",
                 f"{'Request throughput (req/s):':<40}{self.request_throughput:>12.2f}",
                 f"{'Output token throughput (tok/s):':<40}{self.output_throughput:>12.2f}",
                 f"{'Total token throughput (tok/s):':<40}{self.total_token_throughput:>12.2f}"]
        if self.request_goodput is not None:
            lines.append(f"{'Request goodput (req/s):':<40}{self.request_goodput:>12.2f}")
        for name in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p99"):
                label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
                lines.append(f"{label:<40}{getattr(self, f'{stat}_{name}_ms'):>12.2f}")
        return "\n".join(lines)


def summarize(requests: Sequence[Request], duration_s: float,
              slos_ms: Mapping[str, float] | None = None) -> BenchmarkResult:
    """Summarize finished simulated requests over a run of ``duration_s`` seconds."""
    return summarize_latencies([RequestLatencies.of(r) for r in requests
                              if r.finish_time is not None], duration_s, slos_ms)


def summarize_latencies(per_request: Sequence[RequestLatencies], duration_s: float,
                      slos_ms: Mapping[str, float] | None = None) -> BenchmarkResult:
    """Summarize per-request latencies, simulated or measured, over ``duration_s`` seconds."""
    in_range("duration_s", duration_s, 0, low_open=True)
    for name in slos_ms or {}:
        if name not in SLO_METRICS:
            raise ParameterError("slos_ms", f"slos_ms: SLO metric must be one of {SLO_METRICS}, "
                                            f"got {name!r}")
    if not per_request:
        raise ParameterError("per_request", "per_request: no request finished")

    def stats(values) -> tuple[float, float, float]:
        values = np.asarray(values, dtype=float)
        if values.size == 0:
            return 0.0, 0.0, 0.0
        return float(values.mean()), float(np.median(values)), float(np.percentile(values, 99))

    inputs = sum(m.prompt_len for m in per_request)
    outputs = sum(m.output_len for m in per_request)
    goodput = None
    if slos_ms:
        good = sum(all(getattr(m, f"{k}_ms") <= v for k, v in slos_ms.items())
                   for m in per_request)
        goodput = good / duration_s
    ttft = stats([m.ttft_ms for m in per_request])
    tpot = stats([m.tpot_ms for m in per_request if m.output_len > 1])
    itl = stats([x for m in per_request for x in m.itl_ms])
    e2el = stats([m.e2el_ms for m in per_request])
    return BenchmarkResult(
        len(per_request), duration_s, inputs, outputs, len(per_request) / duration_s,
        outputs / duration_s, (inputs + outputs) / duration_s, goodput,
        *ttft, *tpot, *itl, *e2el)
