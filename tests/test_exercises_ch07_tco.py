"""Chapter 7 exercise checks: right answers pass, the usual mistakes are named, "never" is
graded both ways, and the expected values are the ones worked out by hand."""

import pytest

from labkit.checks import ParameterError
from labkit.cost.prices import APIPrice, TokenMix
from labkit.cost.tco import Cloud, Scenario, SelfHosted
from labkit.cost.tokens import Throughput
from labkit.exercises import ch07_tco as ex


def card(input_usd: float, cached_usd: float | None, output_usd: float) -> APIPrice:
    return APIPrice("Test", "m", input_usd, cached_usd, output_usd, "test: given", "2026-12-01")


def test_power():
    # DGX H100: 10.2 kW at the wall (ratio 10.2 / 5.6 over 8 x 700 W); x PUE 1.58 =
    # 16.116 kW; x 730 h = 11,764.68 kWh; x $0.0806 = $948.23 a month.
    assert ex.check_power(948.23)
    assert "PUE" in repr(ex.check_power(600.15))           # 10.2 x 730 x 0.0806
    assert "server around" in repr(ex.check_power(520.6))  # 5.6 x 1.58 x 730 x 0.0806
    assert "both" in repr(ex.check_power(329.5))           # 5.6 x 730 x 0.0806
    assert "720 h" in repr(ex.check_power(935.24))          # 16.116 x 720 x 0.0806
    assert "$150" in repr(ex.check_power(1200))
    assert "Not answered" in repr(ex.check_power(None))
    # An L40S server: 8 x 350 W x 1.5357 (4.3 kW) x 1.1 x 730 h x $0.10 = $345.31.
    assert ex.check_power(345.31, gpu="L40S", server_power_ratio=4.3 / 2.8, pue=1.1,
                          electricity_usd_kwh=0.10)


def test_depreciation():
    # (270,000 - 27,000) / 60 = 4,050.
    assert ex.check_depreciation(4050)
    assert "salvage value" in repr(ex.check_depreciation(4500))
    assert "months, not years" in repr(ex.check_depreciation(48_600))
    assert "instead of what is lost" in repr(ex.check_depreciation(450))
    assert ex.check_depreciation(2000, capex_usd=72_000, years=3, salvage_fraction=0)


def test_api_bill():
    # The default card is OpenAI's GPT-6.1 Sol from the table, $2 / $0.10 / $10 per 1M:
    # 0.8e9 uncached x $2 + 1.2e9 cached x $0.10 + 0.3e9 x $10, per 1M: 1,600 + 120 + 3,000.
    assert ex.check_api_bill(4720)
    assert "full input price" in repr(ex.check_api_bill(7000))    # 4,000 + 3,000
    assert "twice" in repr(ex.check_api_bill(7120))               # 4,000 + 120 + 3,000
    assert "output tokens" in repr(ex.check_api_bill(1720))
    assert "1K" in repr(ex.check_api_bill(4_720_000))
    assert ex.check_api_bill(6000, card=card(3.0, None, 10.0), prompt_tokens=1e9,
                             cached_prompt_tokens=0)
    with pytest.raises(ParameterError, match="cached_prompt_tokens"):
        ex.check_api_bill(1, prompt_tokens=1e9, cached_prompt_tokens=2e9)


def scenario(**hardware_changes) -> Scenario:
    values = dict(gpu="H100 SXM", capex_per_server_usd=270_000, depreciation_years=5, pue=1.4,
                  electricity_usd_kwh=0.10, server_power_ratio=1.0, colocation_usd_kw_month=0,
                  staff_usd_year=90_000, staff_fte=1)
    return Scenario(traffic=TokenMix(1e9, 2e8, 3e8), api=card(3.0, 0.30, 15.0),
                    capacity=Throughput(5000, 1000, 5.0, 0.3, 1, "test"),
                    hardware=SelfHosted(**{**values, **hardware_changes}))


def test_breakeven():
    # A server costs 4,500 + 572.32 = 5,072.32 a month, the admin 7,500; the mix costs
    # 5,190 / 1.2e9 $ a token, and one server's capacity (1.26e11 tokens) is far above the
    # breakeven: 12,572.32 / (5,190 / 1.2e9) = 2.90690e9 tokens a month.
    s = scenario()
    assert ex.check_breakeven(2.9069e9, s)
    assert "output price" in repr(ex.check_breakeven(12_572.32 / 15e-6, s))
    assert "fixed cost" in repr(ex.check_breakeven(5072.32 * 1.2e9 / 5190, s))
    assert "depreciation" in repr(ex.check_breakeven(8072.32 * 1.2e9 / 5190, s))
    assert "there is a breakeven" in repr(ex.check_breakeven("never", s))


def test_breakeven_never():
    # At $0.02 / $0.002 / $0.05 a full server's tokens are worth $2,586 a month: less than
    # the server costs. The right answer is "never"; any number is wrong.
    s = scenario().with_value("api", card(0.02, 0.002, 0.05))
    assert ex.check_breakeven("never", s)
    assert ex.check_breakeven(" Never ", s)
    feedback = ex.check_breakeven(1e10, s)
    assert not feedback and "no breakeven volume" in repr(feedback)
    assert "Not answered" in repr(ex.check_breakeven(None, s))


def test_payback():
    # No staff: running costs are the power, 572.32; 270,000 / (5,190 - 572.32) = 58.47.
    s = scenario(staff_fte=0)
    assert ex.check_payback(58.47, s)
    assert "depreciation" in repr(ex.check_payback(270_000 / (5190 - 5072.32), s))
    assert "running costs" in repr(ex.check_payback(270_000 / 5190, s))
    # With the admin the running costs (8,072.32) exceed the API bill: never.
    assert ex.check_payback("never", scenario())
    assert "no payback" in repr(ex.check_payback(33.4, scenario()))


def test_bridge_cost():
    # 8 GPUs in one 8-GPU instance at $3.99 a GPU-hour for 12 weeks: 8 x 3.99 x 12 x 168 h
    # = $64,350.72. A four-week month gives 8 x 3.99 x 730 x 3 = $69,904.80.
    cloud = Cloud(3.99, gpus_per_instance=8)
    assert ex.check_bridge_cost(64_350.72, cloud, gpus=8, weeks=12)
    assert "four weeks" in repr(ex.check_bridge_cost(69_904.80, cloud, gpus=8, weeks=12))
    # 12 GPUs take two instances (16 GPUs): billing only 12 is named.
    assert ex.check_bridge_cost(2 * 64_350.72, cloud, gpus=12, weeks=12)
    assert "whole instances" in repr(ex.check_bridge_cost(1.5 * 64_350.72, cloud, gpus=12,
                                                          weeks=12))
    with pytest.raises(ParameterError, match="weeks"):
        ex.check_bridge_cost(1.0, cloud, gpus=8, weeks=0)
