"""Checks for the exercises of the chapter 7 lab (``labs/07_tco.ipynb``): cloud, API or your
own servers.

Every expected value is computed by :mod:`labkit.cost` itself (a :class:`SelfHosted`
month, an :class:`~labkit.cost.prices.APIPrice` bill, a :class:`Scenario`'s breakeven and
payback), so the
checks agree with what the lab and the chapter show. The mistakes they name are the ones the
tutorial makes and the ones its readers make: power without PUE or without the server around
the GPUs, a 720-hour month, the flat $150 a GPU; salvage forgotten; cached tokens billed at
the full input price or twice; a breakeven computed from output prices alone, or where there
is none; a payback with the depreciation counted again.
"""

from __future__ import annotations

import math

from labkit.checks import in_range, positive_int
from labkit.cost.prices import APIPrice, TokenMix, api_price
from labkit.cost.tco import Cloud, Scenario, SelfHosted
from labkit.grading import Feedback, check_number

NEVER = "never"
"""The answer to give when no volume (or no month) makes self-hosting pay."""


def _power_hardware(gpu: str, gpus: int, server_power_ratio: float, pue: float,
                    electricity_usd_kwh: float) -> SelfHosted:
    return SelfHosted(gpu=gpu, capex_per_server_usd=0, depreciation_years=1, pue=pue,
                      electricity_usd_kwh=electricity_usd_kwh,
                      server_power_ratio=server_power_ratio, colocation_usd_kw_month=0,
                      staff_usd_year=0, staff_fte=0, gpus_per_server=gpus)


def check_power(answer: object, gpu: str = "H100 SXM", gpus: int = 8,
                server_power_ratio: float = 10.2 / 5.6, pue: float = 1.58,
                electricity_usd_kwh: float = 0.0806) -> Feedback:
    """Lab 07, exercise 1: the monthly electricity bill, in dollars, of one server of ``gpus``
    GPUs at full TDP, with the server's overhead, the facility's PUE and the price per kWh."""
    positive_int("gpus", gpus)
    expected = _power_hardware(gpu, gpus, server_power_ratio, pue,
                               electricity_usd_kwh).month(1).power_usd
    mistakes = {
        "left out the PUE (cooling and power distribution use energy too)": expected / pue,
        "left out the server around the GPUs (CPUs, memory, fans, NICs)":
            expected / server_power_ratio,
        "left out both the PUE and the server around the GPUs":
            expected / pue / server_power_ratio,
        "used a 30-day month (720 h); the average month has 8760 / 12 = 730 h":
            expected * 720 / 730,
        "used the tutorial's flat $150 per GPU per month, whatever the GPU, PUE and price":
            150.0 * gpus,
    }
    return check_number(answer, expected, what="monthly electricity bill", unit="USD",
                        rel_tol=0.005, mistakes=mistakes)


def check_depreciation(answer: object, capex_usd: float = 270_000, years: float = 5,
                       salvage_fraction: float = 0.1) -> Feedback:
    """Lab 07, exercise 2: the monthly straight-line depreciation, in dollars, of a server
    bought for ``capex_usd`` and written off over ``years`` down to its salvage value."""
    in_range("capex_usd", capex_usd, 0, low_open=True)
    hardware = SelfHosted(gpu="H100 SXM", capex_per_server_usd=capex_usd,
                          depreciation_years=years, pue=1, electricity_usd_kwh=0,
                          server_power_ratio=1, colocation_usd_kw_month=0, staff_usd_year=0,
                          staff_fte=0, salvage_fraction=salvage_fraction)
    expected = hardware.month(1).depreciation_usd
    months = years * 12
    mistakes = {
        "forgot the salvage value: only price minus salvage is written off":
            capex_usd / months,
        "wrote off a year's worth: divide by months, not years": expected * 12,
        "wrote off the salvage value instead of what is lost":
            capex_usd * salvage_fraction / months,
    }
    return check_number(answer, expected, what="monthly depreciation", unit="USD",
                        mistakes=mistakes)


def check_api_bill(answer: object, prompt_tokens: float = 2.0e9,
                   cached_prompt_tokens: float = 1.2e9, output_tokens: float = 0.3e9,
                   card: APIPrice | None = None) -> Feedback:
    """Lab 07, exercise 3: the month's API bill, in dollars, for ``prompt_tokens`` prompt
    tokens of which ``cached_prompt_tokens`` were cache hits (OpenAI's ``usage`` convention:
    the hits are among the prompt tokens), and ``output_tokens``, at ``card`` (default:
    OpenAI's GPT-6.1 Sol from chapter 6's table, $2 input, $0.10 cached input, $10 output per
    1M tokens)."""
    card = card or api_price("OpenAI", "GPT-6.1 Sol")
    in_range("cached_prompt_tokens", cached_prompt_tokens, 0, prompt_tokens)
    expected = card.cost_usd(TokenMix(prompt_tokens, output_tokens, cached_prompt_tokens))
    full_input = card.cost_usd(TokenMix(prompt_tokens, 0))
    output = card.cost_usd(TokenMix(0, output_tokens))
    cached = card.cost_usd(TokenMix(cached_prompt_tokens, 0, cached_prompt_tokens))
    mistakes = {
        "billed the cache hits at the full input price": full_input + output,
        "billed the cache hits twice: the prompt tokens already include them":
            full_input + cached + output,
        "left out the output tokens, the dearest ones": expected - output,
        "priced per 1K tokens: the card is per 1M": expected * 1000,
    }
    return check_number(answer, expected, what="monthly API bill", unit="USD",
                        mistakes=mistakes)


def _never_feedback(answer: object, expected_never: bool, reason: str, what: str) -> Feedback:
    """Feedback when the answer or the expected value is "never"."""
    said_never = isinstance(answer, str) and answer.strip().lower() == NEVER
    if expected_never and said_never:
        return Feedback(True, f"Correct: {what} is never. {reason[0].upper()}{reason[1:]}.")
    if expected_never:
        if answer is None:
            return Feedback(False, f"Not answered yet: compute {what}.")
        return Feedback(False, f"Not quite: there is no {what} here; answer {NEVER!r}. A "
                               f"formula that divides by the margin returns a number even "
                               f"when the margin is negative: check its sign first.")
    return Feedback(False, f"Not quite: there is a {what} here; compute it.")


def check_breakeven(answer: object, scenario: Scenario) -> Feedback:
    """Lab 07, exercise 4: the monthly volume (tokens of the whole mix) above which
    self-hosting ``scenario``'s traffic costs less than the API, or ``"never"``."""
    b = scenario.breakeven()
    said_never = isinstance(answer, str) and answer.strip().lower() == NEVER
    if b.never or said_never:
        return _never_feedback(answer, b.never, b.reason, "breakeven volume")
    k = b.servers_at_first
    a = b.api_usd_per_token
    output_only = scenario.api.usd_per_1m_output / 1e6
    month = scenario.hardware.month(k)
    mistakes = {
        "priced every token at the output price: input tokens are cheaper":
            month.total_usd / output_only if output_only else math.inf,
        "left out the fixed cost (the staff)": (month.total_usd - month.staff_usd) / a,
        "left out the depreciation: the servers' price is a monthly cost too":
            (month.total_usd - month.depreciation_usd) / a,
    }
    return check_number(answer, b.first_tokens_month, what="breakeven volume",
                        unit="tokens/month", mistakes=mistakes)


def check_payback(answer: object, scenario: Scenario, against: str = "api") -> Feedback:
    """Lab 07, exercise 5: months until the servers ``scenario``'s traffic needs pay for
    themselves against the API (or ``against="cloud"``), or ``"never"``."""
    p = scenario.payback(against)
    said_never = isinstance(answer, str) and answer.strip().lower() == NEVER
    if p.never or said_never:
        return _never_feedback(answer, p.never, p.reason, "payback")
    costs = scenario.costs()
    alternative = costs.api_usd if against == "api" else costs.cloud_usd
    month = costs.self_hosted
    mistakes = {
        "counted the depreciation as a running cost: the purchase is the capex itself":
            (p.capex_usd / (alternative - month.total_usd)
             if alternative > month.total_usd else math.inf),
        "left out the running costs (power, colocation, staff)": p.capex_usd / alternative,
    }
    return check_number(answer, p.months, what="payback", unit="months", mistakes=mistakes)


def check_bridge_cost(answer: object, cloud: Cloud, gpus: int, weeks: float) -> Feedback:
    """Lab 07, exercise 7: what renting ``gpus`` GPUs from ``cloud`` costs for the ``weeks``
    weeks until owned servers arrive (chapter 7's decision table gives the lead time), in
    dollars: whole instances, every hour, 168 hours a week."""
    positive_int("gpus", gpus)
    in_range("weeks", weeks, 0, low_open=True)
    hours = weeks * 7 * 24
    expected = cloud.usd_for_hours(gpus, hours)
    month = cloud.monthly_usd(gpus)
    mistakes = {
        "counted a month as four weeks (a month has 730 / 168 = 4.35 weeks)": month * weeks / 4,
        "billed only the GPUs needed, not whole instances":
            cloud.usd_gpu_hour * gpus * hours * cloud.billed_fraction,
        "used a 30-day month (720 h) to turn the monthly bill into hours":
            month * hours / 720,
    }
    # A mistake that gives the right number here (whole instances already) says nothing.
    mistakes = {why: value for why, value in mistakes.items()
                if not math.isclose(value, expected, rel_tol=0.005)}
    return check_number(answer, expected, what="cloud bill until the servers arrive",
                        unit="USD", rel_tol=0.005, mistakes=mistakes)
