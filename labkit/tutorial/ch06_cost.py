"""The tutorial's cost calculator (its chapter 6), as written, to hold our numbers against
(:ref:`ch06-tutorial-wrong`).

Its ``InferenceCostCalculator`` prices GPUs from a table typed into the code and tokens from
a second typed table of throughputs, then sizes deployments with ``params / 13``. Each
function here is one of its formulas, unchanged, bugs included; the docstrings say what is
wrong and where labkit does it right. The chapter, the lab and the tests call them to show
each error as a number, never to price anything.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The tutorial's GPU prices, $ per hour: no provider, no pricing model, no date, no source;
#: the RTX rows are "self-build depreciation estimates" mixed in with cloud prices.
TUTORIAL_GPU_COST_PER_HOUR = {"H100-SXM": 3.50, "H100-PCIe": 2.80, "A100-80GB": 1.80,
                              "A100-40GB": 1.20, "L40S": 0.90, "RTX-4090": 0.40,
                              "RTX-3090": 0.25}

#: The tutorial's throughputs, tokens/s per GPU, the same for every model size, from nowhere.
TUTORIAL_THROUGHPUT_TOK_S = {
    "H100-SXM": {"fp16": 3000, "int8": 5000, "int4": 8000},
    "A100-80GB": {"fp16": 1500, "int8": 2500, "int4": 4000},
    "L40S": {"fp16": 800, "int8": 1500, "int4": 2500},
    "RTX-4090": {"fp16": 600, "int8": 1000, "int4": 1800},
}

#: The tutorial's month: 24 x 30 hours (an average month has 730).
TUTORIAL_HOURS_PER_MONTH = 24 * 30


def tutorial_hourly_cost(gpu_type: str, num_gpus: int) -> float:
    """``GPU_COST_PER_HOUR.get(gpu_type, 1.0) * num_gpus``: an unknown or misspelt GPU costs
    $1.00 an hour, silently (:func:`labkit.cost.gpu_hourly_price` raises and names the GPUs
    it knows, and each price has its provider, pricing model, source and date)."""
    return TUTORIAL_GPU_COST_PER_HOUR.get(gpu_type, 1.0) * num_gpus


def tutorial_monthly_cost(hourly_cost: float, utilization: float = 0.7) -> float:
    """``hourly_cost * 24 * 30 * utilization``: a reserved GPU is paid for every hour, idle
    or not, so multiplying by utilization under-states the bill (at 0.7, by 30 %). labkit
    bills every hour of :data:`labkit.cost.prices.HOURS_PER_MONTH` (730)."""
    return hourly_cost * TUTORIAL_HOURS_PER_MONTH * utilization


def tutorial_cost_per_million_tokens(hourly_cost: float, throughput_tokens_per_sec: float,
                                     utilization: float = 0.7) -> float:
    """``hourly_cost / 3600 / throughput * 1e6``. ``utilization`` is accepted and ignored:
    at 50 % utilization a useful token costs twice as much, and this says it costs the same.
    One price for input and output tokens, which cost very different GPU time;
    :func:`labkit.cost.token_cost` prices them apart from a measured throughput."""
    cost_per_sec = hourly_cost / 3600
    return cost_per_sec / throughput_tokens_per_sec * 1_000_000


def tutorial_gpu_count(model_params_b: float, precision: str) -> int:
    """``max(1, int(params / 13))``, halved for INT4: the same count for a 24 GB and an 80 GB
    GPU, and counts like 5 that no tensor-parallel layout can use (64 heads do not split 5
    ways). :func:`labkit.hardware.select_gpu` sizes from chapter 1's memory math and vLLM's
    divisibility rules."""
    gpus = max(1, int(model_params_b / 13))
    if precision == "int4":
        gpus = max(1, gpus // 2)
    return gpus


@dataclass(frozen=True)
class TutorialRow:
    """One row the tutorial's ``compare_deployment`` prints."""

    gpu: str
    precision: str
    num_gpus: int
    total_throughput_tok_s: float
    monthly_usd: float
    usd_per_1m_tokens: float


def tutorial_compare_deployment(model_params_b: float, target_rps: float = 10,
                                avg_input_tokens: int = 500,
                                avg_output_tokens: int = 200) -> list[TutorialRow]:
    """The tutorial's ``compare_deployment`` loop, returning its rows instead of printing.

    Besides the formulas above: the target adds input and output tokens into one throughput;
    GPUs are added one at a time (``int(target / tps) + 1``: one too many when the division
    is exact) as if throughput grew linearly with them; and ``$/1M`` is computed from the
    per-GPU throughput with the hourly cost of *all* the GPUs, which multiplies it by the GPU
    count.
    """
    rows = []
    target_throughput = target_rps * (avg_input_tokens + avg_output_tokens)
    for gpu, throughputs in TUTORIAL_THROUGHPUT_TOK_S.items():
        for precision, tps in throughputs.items():
            base_gpus = tutorial_gpu_count(model_params_b, precision)
            total_throughput = tps * base_gpus
            if total_throughput < target_throughput:
                base_gpus = int(target_throughput / tps) + 1
                total_throughput = tps * base_gpus
            hourly = tutorial_hourly_cost(gpu, base_gpus)
            rows.append(TutorialRow(
                gpu, precision, base_gpus, total_throughput, tutorial_monthly_cost(hourly, 0.7),
                tutorial_cost_per_million_tokens(hourly, total_throughput / base_gpus, 0.7)))
    return rows
