"""Checks for the exercises of the chapter 6 cost lab (``labs/06_cost.ipynb``).

Every expected value comes from :mod:`labkit.cost` itself (``token_cost``,
``replicas_needed``, ``monthly_cost_usd``), so a check agrees with what the lab shows; the
formulas are worked by hand in ``tests/test_cost_*.py``. The mistakes named are the ones the
tutorial's chapter 6.1 makes (utilization ignored or multiplied in, the cost of every GPU
over one GPU's throughput, 24 x 30 hours a month, input and output at one price) and the
usual slips (rounding replicas down, sizing for the mean instead of the peak).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from labkit.checks import in_range, positive_int
from labkit.cost.compare import DeploymentOption, monthly_cost_usd, replicas_needed
from labkit.cost.prices import GPUPrice
from labkit.cost.tokens import Throughput, token_cost
from labkit.tutorial.ch06_cost import TUTORIAL_HOURS_PER_MONTH
from labkit.grading import Feedback, check_number


def check_cost_per_million(answer: object, usd_per_gpu_hour: float = 2.0, num_gpus: int = 4,
                           tok_s: float = 12_000.0, utilization: float = 0.6) -> Feedback:
    """Lab 06, exercise 1: dollars per million tokens for a replica of ``num_gpus`` GPUs at
    ``usd_per_gpu_hour`` each that serves ``tok_s`` tokens/s when busy, busy a share
    ``utilization`` of the hours it is paid for."""
    in_range("usd_per_gpu_hour", usd_per_gpu_hour, 0, low_open=True)
    positive_int("num_gpus", num_gpus)
    in_range("tok_s", tok_s, 0, low_open=True)
    in_range("utilization", utilization, 0, 1, low_open=True)
    throughput = Throughput(tok_s / 2, tok_s / 2, 1.0, 0.5, num_gpus, "the exercise")
    expected = token_cost(throughput, usd_per_gpu_hour, utilization).usd_per_1m_blended
    mistakes = {
        "ignore utilization, as the tutorial's cost_per_million_tokens does (idle hours are "
        "paid too: divide by it)": expected * utilization,
        "multiply by utilization instead of dividing by it": expected * utilization ** 2,
        "price one GPU where the replica holds num_gpus": expected / num_gpus,
        "divide the cost of all the GPUs by one GPU's share of the throughput, as the "
        "tutorial's compare_deployment does": expected * num_gpus,
    }
    return check_number(answer, expected, what="$ per 1M tokens", unit="$", mistakes=mistakes)


def check_monthly_cost(answer: object, replicas: int = 3, gpus_per_replica: int = 2,
                       usd_per_gpu_hour: float = 2.5, utilization: float = 0.6) -> Feedback:
    """Lab 06, exercise 2: a month of a fixed fleet of ``replicas`` replicas, busy on average
    a share ``utilization`` of the time."""
    in_range("utilization", utilization, 0, 1, low_open=True)
    expected = monthly_cost_usd(replicas, gpus_per_replica, usd_per_gpu_hour)
    mistakes = {
        "multiply by utilization, as the tutorial's estimate_monthly_cost does (a reserved "
        "GPU bills every hour, busy or idle)": expected * utilization,
        "count a month as 24 x 30 hours (an average month has 730)":
            expected * TUTORIAL_HOURS_PER_MONTH / (365 * 24 / 12),
        "count replicas, not GPUs: each replica holds gpus_per_replica":
            expected / gpus_per_replica,
    }
    return check_number(answer, expected, what="monthly cost", unit="$", rel_tol=0.001,
                        mistakes=mistakes)


def check_replicas(answer: object, peak_request_rate: float = 45.0,
                   mean_request_rate: float = 20.0, max_request_rate: float = 12.0) -> Feedback:
    """Lab 06, exercise 3: replicas a fixed fleet needs for a peak of ``peak_request_rate``
    when one replica serves ``max_request_rate`` within the SLO."""
    in_range("mean_request_rate", mean_request_rate, 0, peak_request_rate)
    expected = replicas_needed(peak_request_rate, max_request_rate)
    mistakes = {
        "round down: the last fraction of a replica is a whole replica":
            math.floor(peak_request_rate / max_request_rate),
        "size for the mean: the peak is what must be served within the SLO":
            replicas_needed(mean_request_rate, max_request_rate),
    }
    return check_number(answer, expected, what="replicas", unit="replicas", rel_tol=0,
                        mistakes=mistakes)


def check_input_output_prices(answer: object, throughput: Throughput,
                              price: GPUPrice | float) -> Feedback:
    """Lab 06, exercise 4: ``(usd per 1M input tokens, usd per 1M output tokens)`` for
    ``throughput`` at ``price``, at full use, splitting the GPU time by prefill share."""
    cost = token_cost(throughput, price)
    expected = (cost.usd_per_1m_input, cost.usd_per_1m_output)
    if answer is None:
        return Feedback(False, "Not answered yet: compute (input price, output price).")
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        return Feedback(False, f"Expected a pair (input, output), got {answer!r}.")
    blended = cost.usd_per_1m_blended
    share = throughput.prefill_share
    by_tokens = throughput.input_tok_s / throughput.total_tok_s
    swapped = token_cost(replace(throughput, prefill_share=1 - share), price)
    parts = []
    for value, target, what, wrong_share in (
            (answer[0], expected[0], "$ per 1M input tokens", swapped.usd_per_1m_input),
            (answer[1], expected[1], "$ per 1M output tokens", swapped.usd_per_1m_output)):
        parts.append(check_number(value, target, what=what, unit="$", mistakes={
            "price input and output alike, as the tutorial does: splitting the bill by token "
            f"counts gives that blended price too, but the tokens are {by_tokens:.0%} input "
            f"while prefill takes {share:.0%} of the GPU time": blended,
            "swap the shares: prefill_share is the input tokens' part of the GPU time":
                wrong_share,
        }))
    return Feedback(all(parts), " ".join(p.message for p in parts))


def check_cheapest_deployment(answer: object, options: Sequence[DeploymentOption]) -> Feedback:
    """Lab 06, stretch exercise: the label of the deployment with the cheapest month among
    ``options`` (from :func:`labkit.cost.compare.compare_deployments`)."""
    runnable = [o for o in options if o.problem is None]
    if not runnable:
        return Feedback(False, "No option meets the SLO: loosen it or add GPUs.")
    cheapest = min(o.fleet.monthly_usd for o in runnable)
    # Ties are common: two replicas of 2 GPUs bill what one replica of 4 does.
    best = {o.deployment.label for o in runnable
            if math.isclose(o.fleet.monthly_usd, cheapest, rel_tol=1e-9)}
    if answer is None:
        return Feedback(False, "Not answered yet: give a deployment's label, e.g. "
                               f"{runnable[-1].deployment.label!r}.")
    if answer in best:
        return Feedback(True, f"Correct: {answer}, ${cheapest:,.0f} a month"
                              + (f" (tied with {', '.join(sorted(best - {answer}))})."
                                 if len(best) > 1 else "."))
    cheapest_token = min(runnable, key=lambda o: o.cost.usd_per_1m_blended)
    cheapest_hour = min(runnable, key=lambda o: o.price.usd_per_gpu_hour * o.deployment.num_gpus)
    if answer == cheapest_token.deployment.label and answer not in best:
        return Feedback(False, "Not quite: that is the cheapest token at full use, but the "
                               "month pays for whole replicas, idle hours included.")
    if answer == cheapest_hour.deployment.label:
        return Feedback(False, "Not quite: that is the cheapest replica-hour, but it serves "
                               "so little within the SLO that the fleet needs more of them.")
    labels = {o.deployment.label for o in options}
    if answer in labels:
        return Feedback(False, "Not quite: compare the $/month column of the runnable rows.")
    return Feedback(False, f"{answer!r} is not one of the options' labels.")
