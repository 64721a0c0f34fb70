"""Dollars per million tokens from a throughput someone measured or simulated
(:ref:`ch06-token-cost`, :ref:`ch06-input-output`).

The price of a token is the GPU time it takes. One replica of a deployment holds
``num_gpus`` GPUs at ``usd_per_gpu_hour`` each, whether it is busy or not, and sustains a
throughput (from chapter 3's simulator at a latency SLO, or from a ``labkit.bench`` run):

    $ per second      = num_gpus * usd_per_gpu_hour / 3600
    $ per 1M tokens   = $ per second / (utilization * tokens per second) * 1e6

``utilization`` is the share of the paid hours in which the replica serves at that throughput
(average load over capacity): at 50 % a useful token costs twice what it costs at 100 %,
because the idle hours are paid too.

Input and output tokens are priced apart because they cost very different GPU time. A
prompt is prefilled hundreds of tokens per step at the GPU's compute peak; each output token
needs a step of its own that reads every weight. We split the busy GPU time in two:

- **prefill**: what the prompts alone would take on the same cost model, packed into steps
  of ``max_num_batched_tokens`` tokens (:func:`prefill_only_time_s`): the time a separate
  prefill pool would spend on them, as in disaggregated serving;
- **decode**: the rest of the busy time, including whatever sharing a step with prefill
  saved or cost.

The prompt tokens pay ``prefill_share`` of the bill, the output tokens the rest. The first
output token comes out of the prefill step, so it rides with the prompt. The two prices
together always recover the whole bill (a test holds that), whatever the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.cost.prices import GPUPrice
from labkit.simulate import BenchmarkResult, SimulationResult, StepCostModel


@dataclass(frozen=True)
class Throughput:
    """What one replica sustains, and where that number came from (:ref:`ch06-throughput-slo`).

    ``input_tok_s`` and ``output_tok_s`` are prompt and generated tokens per second;
    ``prefill_share`` is the share of the replica's busy GPU time spent on prefill;
    ``num_gpus`` the GPUs one replica holds (its tensor-parallel size); ``provenance`` says
    how the numbers were obtained ("simulated: ..." or "measured: ...").
    """

    input_tok_s: float
    output_tok_s: float
    request_rate: float
    prefill_share: float
    num_gpus: int
    provenance: str

    def __post_init__(self) -> None:
        for name in ("input_tok_s", "output_tok_s", "request_rate"):
            in_range(name, getattr(self, name), 0, low_open=True)
        in_range("prefill_share", self.prefill_share, 0, 1)
        for name in ("input_tok_s", "output_tok_s", "request_rate", "prefill_share"):
            # Plain floats, even when measured from NumPy arrays: a record prints as numbers.
            object.__setattr__(self, name, float(getattr(self, name)))
        positive_int("num_gpus", self.num_gpus)
        if not self.provenance.strip():
            raise ParameterError("provenance", "provenance must say where the throughput "
                                               "comes from")

    @property
    def total_tok_s(self) -> float:
        return self.input_tok_s + self.output_tok_s


@dataclass(frozen=True)
class TokenCost:
    """Dollars per million tokens for one replica at a utilization (:ref:`ch06-token-cost`)."""

    usd_per_1m_input: float
    usd_per_1m_output: float
    usd_per_1m_blended: float
    usd_per_replica_hour: float
    utilization: float
    throughput: Throughput
    price_citation: str

    @property
    def provenance(self) -> str:
        """Both halves of the number: the throughput's origin and the price's."""
        return f"throughput {self.throughput.provenance}; price {self.price_citation}"

    def __str__(self) -> str:
        return (f"${self.usd_per_1m_input:.3f} per 1M input, ${self.usd_per_1m_output:.3f} "
                f"per 1M output (${self.usd_per_1m_blended:.3f} blended) at "
                f"{self.utilization:.0%} utilization, ${self.usd_per_replica_hour:.2f} per "
                f"replica-hour")


def token_cost(throughput: Throughput, price: GPUPrice | float,
               utilization: float = 1.0) -> TokenCost:
    """$ per 1M input, output and blended tokens (:ref:`ch06-input-output`).

    ``price`` is a row of the price table or a number (dollars per GPU-hour, your own quote).
    ``utilization`` in (0, 1] is the share of the paid hours spent serving at
    ``throughput``: the cost of a useful token is divided by it.
    """
    in_range("utilization", utilization, 0, 1, low_open=True)
    if isinstance(price, GPUPrice):
        usd_per_gpu_hour, citation = price.usd_per_gpu_hour, price.citation()
    else:
        usd_per_gpu_hour = in_range("price", price, 0, low_open=True)
        citation = f"${usd_per_gpu_hour:g} per GPU-hour (given)"
    replica_hour = usd_per_gpu_hour * throughput.num_gpus
    usd_per_useful_s = replica_hour / 3600 / utilization
    share = throughput.prefill_share
    return TokenCost(
        usd_per_1m_input=usd_per_useful_s * share / throughput.input_tok_s * 1e6,
        usd_per_1m_output=usd_per_useful_s * (1 - share) / throughput.output_tok_s * 1e6,
        usd_per_1m_blended=usd_per_useful_s / throughput.total_tok_s * 1e6,
        usd_per_replica_hour=replica_hour, utilization=utilization, throughput=throughput,
        price_citation=citation)


def prefill_only_time_s(prompt_lens: Sequence[int], step_cost: StepCostModel,
                        max_num_batched_tokens: int) -> float:
    """Seconds the prompts alone take on ``step_cost``, prefilled in steps of at most
    ``max_num_batched_tokens`` tokens, in order, a prompt split across steps where it does
    not fit (chunked prefill) (:ref:`ch06-input-output`)."""
    positive_int("max_num_batched_tokens", max_num_batched_tokens)
    total, rows, room = 0.0, [], max_num_batched_tokens
    for prompt_len in prompt_lens:
        done = 0
        while done < prompt_len:
            take = min(room, prompt_len - done)
            rows.append((take, done))
            done += take
            room -= take
            if room == 0:
                total += step_cost(rows)
                rows, room = [], max_num_batched_tokens
    return total + (step_cost(rows) if rows else 0.0)


def busy_time_s(result: SimulationResult) -> float:
    """Seconds the engine spent in steps during a simulation (idle gaps left out)."""
    return sum(step.end_s - step.start_s for step in result.steps)


def prefill_share(prefill_s: float, busy_s: float) -> float:
    """Share of the busy time that goes to prefill: ``prefill_s / busy_s``
    (:ref:`ch06-input-output`).

    The prompts alone should take no longer than the run they are part of (a step shared
    with decodes reads the weights once for both); a ratio above 1 means the two times do
    not belong together, and is refused.
    """
    in_range("prefill_s", prefill_s, 0)
    in_range("busy_s", busy_s, 0, low_open=True)
    if prefill_s > busy_s * (1 + 1e-9):
        raise ParameterError("prefill_s", f"prefill alone ({prefill_s:.3f} s) cannot take "
                                          f"longer than the whole busy time ({busy_s:.3f} s)")
    return min(1.0, prefill_s / busy_s)


def throughput_from_benchmark(result: BenchmarkResult, *, num_gpus: int,
                              prefill_tok_s: float, description: str) -> Throughput:
    """The throughput a ``labkit.bench`` run measured, as :class:`Throughput`
    (:ref:`ch06-throughput-slo`).

    ``prefill_tok_s`` is the server's prefill rate, measured by a second run whose requests
    ask for one output token each (``total_input_tokens / duration_s`` of that run): the
    prompts of ``result`` take ``total_input_tokens / prefill_tok_s`` seconds of its
    ``duration_s``, and decode the rest (a server under load is busy throughout). The
    benchmark's duration includes its last requests' tail, so the rates are slightly low.
    ``description`` names the run (server, model, machine, date) for the provenance.
    """
    in_range("prefill_tok_s", prefill_tok_s, 0, low_open=True)
    prefill_s = result.total_input_tokens / prefill_tok_s
    return Throughput(
        input_tok_s=result.total_input_tokens / result.duration_s,
        output_tok_s=result.output_throughput, request_rate=result.request_throughput,
        prefill_share=prefill_share(prefill_s, result.duration_s), num_gpus=num_gpus,
        provenance=f"measured: labkit.bench run, {description}, {result.completed} requests "
                   f"in {result.duration_s:.1f} s, prefill {prefill_tok_s:,.0f} tok/s")
