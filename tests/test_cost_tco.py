"""Chapter 7's TCO model: hand-derived costs, the breakeven on the step function (checked by
brute force over volumes), the "never" cases, the tutorial's formula shown wrong, the sourced
tables, bad input, and the tornado's ordering."""

import math
import re

import matplotlib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.cost.prices import APIPrice, GPUPrice
from labkit.cost.sensitivity import (Swing, plot_cost_vs_volume, plot_tornado,
                                     sourced_swings, tco_report, tco_widget, tornado)
from labkit.cost.tco import (SECONDS_PER_MONTH, Cloud, Scenario, SelfHosted, capex_for, capex_rows,
                             input_range, input_row, input_rows)
from labkit.tutorial.ch07_tco import tutorial_compare_cloud_vs_selfhost
from labkit.cost.prices import HOURS_PER_MONTH, TokenMix
from labkit.cost.tokens import Throughput
from labkit.data import read_csv
from labkit.hardware import get_gpu

matplotlib.use("Agg")


def hardware(**changes) -> SelfHosted:
    values = dict(gpu="H100 SXM", capex_per_server_usd=270_000, depreciation_years=5, pue=1.4,
                  electricity_usd_kwh=0.10, server_power_ratio=1.0, colocation_usd_kw_month=0,
                  staff_usd_year=0, staff_fte=0)
    return SelfHosted(**{**values, **changes})


def card(input_usd: float, cached_usd: float | None, output_usd: float) -> APIPrice:
    return APIPrice("Test", "m", input_usd, cached_usd, output_usd, "test: given", "2026-12-01")


def capacity(output_tok_s: float, num_gpus: int = 1) -> Throughput:
    """A replica's throughput; a scenario sizes its fleet by the output rate alone."""
    return Throughput(5 * output_tok_s, output_tok_s, output_tok_s / 200, 0.3, num_gpus,
                      "test: given")


# 1e9 prompt tokens a month, 3e8 of them cache hits (OpenAI's usage convention), 2e8 output.
MIX = TokenMix(input_tokens=1e9, output_tokens=2e8, cached_input_tokens=3e8)
API = card(3.0, 0.30, 15.0)


def scenario(**changes) -> Scenario:
    values = dict(traffic=MIX, api=API, capacity=capacity(1000), hardware=hardware())
    return Scenario(**{**values, **changes})


# --- hand-derived monthly costs -------------------------------------------------------------


def test_month_is_730_hours():
    assert HOURS_PER_MONTH == 730 and SECONDS_PER_MONTH == 2_628_000


def test_power_for_eight_h100():
    # 8 x 700 W = 5.6 kW of GPUs; x PUE 1.4 = 7.84 kW at the meter; x 730 h = 5723.2 kWh;
    # x $0.10 = $572.32 a month.
    month = hardware().month(1)
    assert month.it_power_kw == pytest.approx(5.6)
    assert month.energy_kwh == pytest.approx(5723.2)
    assert month.power_usd == pytest.approx(572.32)
    # The server around the GPUs: DGX H100 draws up to 10.2 kW, ratio 10.2 / 5.6, so the
    # meter sees 10.2 kW x 1.4 x 730 h = 10,424.4 kWh -> $1,042.44. At half the TDP on
    # average, half of it.
    dgx = hardware(server_power_ratio=10.2 / 5.6).month(1)
    assert dgx.power_usd == pytest.approx(1042.44)
    assert hardware(server_power_ratio=10.2 / 5.6, gpu_power_fraction=0.5).month(
        1).power_usd == pytest.approx(521.22)
    # The TDP comes from chapter 1's table: an L40S (350 W) costs half an H100's power.
    assert get_gpu("L40S").tdp_w == 350
    assert hardware(gpu="L40S").month(1).power_usd == pytest.approx(286.16)


def test_depreciation_straight_line_with_salvage():
    # $270,000 written off over 5 years = 60 months: $4,500 a month; keeping 10 % as salvage,
    # $243,000 over 60 months = $4,050.
    assert hardware().month(1).depreciation_usd == pytest.approx(4500)
    assert hardware(salvage_fraction=0.1).month(1).depreciation_usd == pytest.approx(4050)
    assert hardware(depreciation_years=3).month(2).depreciation_usd == pytest.approx(15_000)


def test_monthly_total_by_hand():
    # Server overhead 1.5: 8.4 kW of IT capacity. Depreciation 270,000 x 0.9 / 60 = 4,050.
    # Power 8.4 x 1.4 x 730 x 0.10 = 858.48. Colocation 8.4 kW x $150 = 1,260. Staff half
    # an admin at $90,000 a year = 3,750. Total 9,918.48; running cost 5,868.48.
    month = hardware(salvage_fraction=0.1, server_power_ratio=1.5, colocation_usd_kw_month=150,
                     staff_usd_year=90_000, staff_fte=0.5).month(1)
    assert month.it_power_kw == pytest.approx(8.4)
    assert month.power_usd == pytest.approx(858.48)
    assert month.colocation_usd == pytest.approx(1260)
    assert month.staff_usd == pytest.approx(3750)
    assert month.total_usd == pytest.approx(9918.48)
    assert month.opex_usd == pytest.approx(5868.48)


def test_api_bill_by_hand():
    # 700M uncached input x $3 + 300M cached x $0.30 + 200M output x $15, per 1M:
    # 2,100 + 90 + 3,000 = $5,190, over 1.2e9 tokens (the cached ones are among the input).
    assert API.cost_usd(MIX) == pytest.approx(5190)
    assert MIX.total_tokens == 1.2e9
    assert scenario().breakeven().api_usd_per_token == pytest.approx(5190 / 1.2e9)
    # No cached price on the card: all 1e9 input tokens pay $3, 3,000 + 3,000 output.
    assert card(3.0, None, 15.0).cost_usd(MIX) == pytest.approx(6000)


def test_cloud_bills_every_hour_it_runs():
    # 8 GPUs at $3.50 kept up all month: 3.5 x 8 x 730 = $20,440, whatever the utilization.
    assert Cloud(3.50).monthly_usd(8) == pytest.approx(20_440)
    # Instances of 8: 9 GPUs rent two instances.
    assert Cloud(3.50, gpus_per_instance=8).monthly_usd(9) == pytest.approx(40_880)
    # Replicas actually stopped a third of the time: two thirds of the hours.
    assert Cloud(3.50, billed_fraction=2 / 3).monthly_usd(3) == pytest.approx(5110)
    row = GPUPrice("H100 SXM", "P", "on_demand", 4.0, "https://example.com", "2026-11",
                   min_gpus=8)
    cloud = Cloud.from_price(row)
    assert cloud.gpus_per_instance == 8 and "example.com" in cloud.provenance


def test_sizing_in_replicas_and_servers():
    # 2e8 output tokens a month = 76.1 tok/s on average; at 3x peak, 228.3 tok/s; replicas of
    # 2 GPUs at 50 tok/s: ceil(4.57) = 5 replicas, 10 GPUs, 4 per server -> 2 servers.
    s = scenario(capacity=capacity(50, 2), peak_to_average=3.0)
    assert s.replicas_needed() == 5 and s.gpus_needed() == 10
    assert s.servers_needed() == 2            # 8 GPUs a server: 4 replicas each
    assert s.costs().servers == 2 and s.costs().gpus_needed == 10
    with pytest.raises(ParameterError, match="capacity"):
        scenario(capacity=capacity(50, 16))


# --- the breakeven, on the step function ----------------------------------------------------


def test_breakeven_by_hand_one_step():
    # No fixed cost. A server (8 replicas of 1 GPU at 1000 tok/s) serves
    # 8 x 1000 x 2,628,000 = 2.1024e10 output tokens, x 6 (1.2e9 / 2e8) = 1.26144e11 tokens
    # of the mix a month. The API charges 5190 / 1.2e9 $/token. A server costs 4,500 + 572.32
    # = 5,072.32 a month, so self-hosting wins above 5,072.32 / (5190 / 1.2e9)
    # = 1.17280e9 tokens a month, on the first step, and stays ahead.
    b = scenario().breakeven()
    assert not b.never
    assert b.server_capacity_tokens_month == pytest.approx(1.26144e11)
    assert b.per_server_usd_month == pytest.approx(5072.32)
    assert b.first_tokens_month == pytest.approx(5072.32 * 1.2e9 / 5190)
    assert b.stable_tokens_month == b.first_tokens_month
    assert b.num_crossings == 1 and b.servers_at_first == 1


def step_scenario(**changes) -> Scenario:
    # All-output traffic at $1 per 1M tokens; one-GPU servers serving 1000 tok/s:
    # 2.628e9 tokens a month per server, worth $2,628 of API spend. A server costs
    # 72,000 / 60 = $1,200 a month (no power, no colocation); one admin, $60,000 a year, is
    # a fixed $5,000 a month.
    values = dict(traffic=TokenMix(0, 1e9), api=card(0, 0, 1.0), capacity=capacity(1000),
                  hardware=hardware(capex_per_server_usd=72_000, electricity_usd_kwh=0,
                                    gpus_per_server=1, staff_usd_year=60_000, staff_fte=1))
    return Scenario(**{**values, **changes})


def test_breakeven_with_several_crossings_by_hand():
    # Margin per server m = 2628 - 1200 = $1,428. Self-hosting first wins on the step with
    # k > 5000 / 1428 = 3.5 servers: k = 4, above (5000 + 4 x 1200) / 1e-6 = 9.8e9 tokens
    # (inside step 4: 7.884e9 .. 1.0512e10). At 4 x 2.628e9 = 1.0512e10 a fifth server is
    # needed: $11,000 against the API's $10,512, so the API wins again, until
    # 11,000 / 1e-6 = 1.1e10. From 5 servers on, k > (5000 + 1200) / 1428 = 4.3: stable.
    b = step_scenario().breakeven()
    assert not b.never and b.servers_at_first == 4
    assert b.first_tokens_month == pytest.approx(9.8e9)
    assert b.stable_tokens_month == pytest.approx(1.1e10)
    assert b.num_crossings == 3
    assert [(round(c.tokens_month / 1e6), c.cheaper, c.servers) for c in b.crossings] == [
        (9800, "self-hosted", 4), (10512, "api", 5), (11000, "self-hosted", 5)]
    assert "API wins again" in str(b)


def crossings_by_brute_force(s: Scenario, upto: float, points: int = 20_000):
    """Where the sign of self-hosted minus API changes, on a fine grid plus just either side
    of every step edge: computed from the cost functions alone, not the breakeven formula."""
    q = s.server_capacity_tokens_month
    grid = {upto * i / points for i in range(1, points + 1)}
    grid |= {k * q * f for k in range(1, int(upto / q) + 2) for f in (1 - 1e-9, 1 + 1e-9)}
    changes, previous = [], None
    for v in sorted(grid):
        costs = s.costs(v)
        cheaper = "self-hosted" if costs.self_hosted_usd < costs.api_usd else "api"
        if cheaper != previous and previous is not None:
            changes.append((v, cheaper))
        previous = cheaper
    return changes


def test_breakeven_matches_brute_force():
    s = step_scenario()
    b = s.breakeven()
    found = crossings_by_brute_force(s, 2e10)
    assert [c for _, c in found] == [c.cheaper for c in b.crossings]
    q = s.server_capacity_tokens_month
    for (v, _), crossing in zip(found, b.crossings, strict=True):
        assert abs(v - crossing.tokens_month) <= 2e10 / 20_000 + 1e-6 * q


@settings(max_examples=40, deadline=None)
@given(out_price=st.floats(0.2, 20), tok_s=st.floats(100, 5000), capex=st.floats(1e4, 4e5),
       staff=st.floats(0, 3), per_server=st.sampled_from([1, 2, 8]))
def test_breakeven_agrees_with_the_cost_functions(out_price, tok_s, capex, staff, per_server):
    s = Scenario(traffic=TokenMix(4e8, 1e8, 1e8),
                 api=card(out_price / 5, out_price / 50, out_price), capacity=capacity(tok_s),
                 hardware=hardware(capex_per_server_usd=capex, gpus_per_server=per_server,
                                   staff_usd_year=100_000, staff_fte=staff))
    b = s.breakeven()
    q = s.server_capacity_tokens_month
    if b.never:
        # Never cheaper at the top of any step (where self-hosting is at its best), up to
        # 50 servers.
        for k in range(1, 51):
            costs = s.costs(k * q)
            assert costs.self_hosted_usd >= costs.api_usd * (1 - 1e-9)
        return
    v = b.first_tokens_month
    above, below = s.costs(v * (1 + 1e-6)), s.costs(v * (1 - 1e-6))
    assert above.self_hosted_usd < above.api_usd
    assert below.self_hosted_usd >= below.api_usd or v == q * (b.servers_at_first - 1)
    stable = b.stable_tokens_month
    for k in range(1, 6):       # past the stable point, self-hosting wins at every step start
        costs = s.costs(stable + k * q * 0.999)
        assert costs.self_hosted_usd < costs.api_usd


def test_never_when_the_api_is_cheaper_per_token_than_a_full_server():
    # At $0.02 / $0.002 / $0.05 per 1M the mix costs 14 + 0.6 + 10 = $24.6 per 1.2e9 tokens;
    # a full server's 1.26144e11 tokens are worth $2,586 a month, less than the $5,072 the
    # server costs: no volume pays for it. No division by zero either.
    s = scenario(api=card(0.02, 0.002, 0.05))
    b = s.breakeven()
    assert b.never and b.first_tokens_month is None
    assert b.margin_usd_per_server_month < 0
    assert "cheaper per token than the marginal self-hosted token" in b.reason
    assert str(b).startswith("never")
    for k in (1, 2, 10, 1000):
        costs = s.costs(k * s.server_capacity_tokens_month)
        assert costs.self_hosted_usd > costs.api_usd


def test_never_when_the_api_is_free_or_the_margin_is_zero():
    assert "costs nothing" in scenario(api=card(0, 0, 0)).breakeven().reason
    # Make a full server cost exactly what the API charges for its tokens: all-output
    # traffic at $1 per 1M; one-GPU servers at 1000 tok/s serve 2.628e9 tokens = $2,628 a
    # month; a server written off at 2628 x 60 = $157,680 over 5 years costs $2,628 a month.
    s = step_scenario(hardware=hardware(capex_per_server_usd=157_680, electricity_usd_kwh=0,
                                        gpus_per_server=1))
    b = s.breakeven()
    assert b.margin_usd_per_server_month == pytest.approx(0, abs=1e-9)
    assert b.never


# --- payback --------------------------------------------------------------------------------


def test_payback_by_hand():
    # At the scenario's traffic: one server; the API bills $5,190; running the server costs
    # $572.32 (power only); capex $270,000: 270,000 / (5,190 - 572.32) = 58.47 months, within
    # the 60-month life.
    p = scenario().payback("api")
    assert not p.never and p.months == pytest.approx(270_000 / (5190 - 572.32))
    assert p.within_life
    # Against a cloud that rents 8-GPU instances at $3.50 per GPU-hour, kept up:
    # 20,440 - 572.32 a month -> 13.6 months.
    p = scenario(cloud=Cloud(3.50, gpus_per_instance=8)).payback("cloud")
    assert p.months == pytest.approx(270_000 / (20_440 - 572.32))
    # Against 1 rented GPU (the traffic needs one): 2,555 - 572.32 -> 136 months, past the life.
    assert scenario(cloud=Cloud(3.50)).costs().gpus_needed == 1
    assert not scenario(cloud=Cloud(3.50)).payback("cloud").within_life


def test_payback_never_when_running_costs_exceed_the_alternative():
    p = scenario(api=card(0.02, 0.002, 0.05)).payback("api")
    assert p.never and p.months is None and "no monthly saving" in p.reason
    with pytest.raises(ParameterError, match="cloud"):
        scenario().payback("cloud")
    with pytest.raises(ParameterError, match="against"):
        scenario().payback("spot")


# --- the tutorial, shown wrong --------------------------------------------------------------


def test_tutorial_numbers_as_it_prints_them():
    t = tutorial_compare_cloud_vs_selfhost()
    # 3.50 x 8 x 24 x 30 x 0.7 = 14,112; hardware (30,000 + 3,000) x 8 = 264,000;
    # ops 150 x 8 + 500 + 2,000 = 3,700; 24 months: 338,688 cloud, 352,800 self-hosted.
    assert t.cloud_monthly_usd == pytest.approx(14_112)
    assert t.hardware_usd == 264_000 and t.monthly_ops_usd == 3700
    assert t.cloud_total_usd == pytest.approx(338_688) and t.selfhost_total_usd == 352_800
    assert t.recommends == "cloud" and t.breakeven_months is None


def test_tutorial_discounts_a_bill_that_is_paid_in_full():
    # Eight reserved GPUs are billed every hour: 3.50 x 8 x 730 = 20,440 a month. The
    # tutorial bills 70 % of a 720-hour month: 14,112, 31 % short.
    t = tutorial_compare_cloud_vs_selfhost()
    real = Cloud(3.50).monthly_usd(8)
    assert real == pytest.approx(20_440)
    assert 1 - t.cloud_monthly_usd / real == pytest.approx(0.3096, abs=1e-4)


def test_tutorial_payback_depends_on_an_arbitrary_horizon():
    # The hardware pays back in 264,000 / (14,112 - 3,700) = 25.4 months on the tutorial's own
    # numbers; yet over 24 months it prints "use the cloud" and no payback at all, over 36
    # months it recommends self-hosting with a payback of 25.4.
    short, long = (tutorial_compare_cloud_vs_selfhost(months=m) for m in (24, 36))
    assert short.breakeven_months is None and short.recommends == "cloud"
    assert long.breakeven_months == pytest.approx(264_000 / 10_412)
    # Guarded, the same question has an answer whatever the horizon.
    s = scenario(hardware=hardware(capex_per_server_usd=264_000, electricity_usd_kwh=0,
                                   staff_usd_year=12 * 3700, staff_fte=1),
                 cloud=Cloud(3.50, billed_fraction=0.7 * 720 / HOURS_PER_MONTH))
    s = s.with_value("capacity", capacity(1e6, 8))  # one server's worth
    assert s.payback("cloud").months == pytest.approx(264_000 / 10_412)


def test_tutorial_prices_unknown_gpus_silently():
    # "H100" is not a key of its table: it silently prices an H100 at $2.00/h and $15,000.
    t = tutorial_compare_cloud_vs_selfhost(gpu_type="H100")
    assert t.price_is_fallback and t.hourly_usd == 2.0 and t.gpu_price_usd == 15_000
    with pytest.raises(ValueError, match="unknown GPU"):
        hardware(gpu="H100-SXMX")


def test_tutorial_power_ignores_tdp_pue_and_price():
    # $150 per GPU per month whatever the GPU: our model gives 8 x 350 W vs 8 x 700 W half the
    # bill, and California's industrial rate of 2024 (21.53 c) 3.7x New Mexico's of 2023 (5.75 c).
    h100, l40s = hardware().month(1), hardware(gpu="L40S").month(1)
    assert l40s.power_usd == pytest.approx(h100.power_usd / 2)
    low, high = input_range("electricity_usd_kwh")
    ratio = (hardware(electricity_usd_kwh=high.value).month(1).power_usd
             / hardware(electricity_usd_kwh=low.value).month(1).power_usd)
    assert ratio == pytest.approx(21.53 / 5.75)


# --- the sourced tables ---------------------------------------------------------------------

_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


@pytest.mark.parametrize("name", ["gpu_capex.csv", "tco_inputs.csv"])
def test_every_row_is_sourced_and_dated(name):
    rows = read_csv(name)
    assert rows
    for row in rows:
        assert row["source"].startswith("https://"), row
        assert _DATE.match(row["as_of"]), row
        assert None not in row and all(v is not None for v in row.values()), row


def test_capex_rows_name_chapter_1_gpus():
    for row in capex_rows():
        assert get_gpu(row.gpu).name == row.gpu
        assert 0 < row.price_low_usd <= row.price_high_usd
    dgx = capex_for("H100 SXM", gpus=8)
    assert {r.price_low_usd for r in dgx} == {199_000, 270_000, 317_000}
    assert capex_for("A100 80GB", condition="used")[0].price_high_usd == 9000
    with pytest.raises(ParameterError, match="purchase price"):
        capex_for("MI300X")


def test_server_power_ratios_are_the_quoted_wattages():
    # DGX H100: 10.2 kW over 8 x 700 W; PCIe servers: 4.3 kW and 5 kW over 8 x 350 W.
    ratios = sorted(r.value for r in input_rows() if r.input == "server_power_ratio")
    assert ratios == pytest.approx(sorted([10.2 / 5.6, 4.3 / 2.8, 5.0 / 2.8]), abs=1e-4)


def test_input_ranges():
    low, high = input_range("pue")
    assert (low.value, high.value) == (1.09, 1.54)
    assert input_row("electricity_usd_kwh", "US average").value == 0.0813
    low, high = input_range("gpu_power_fraction")  # DGX H100: 6.5 and 8.5 kW of 10.2
    assert (low.value, high.value) == pytest.approx((6.5 / 10.2, 8.5 / 10.2), abs=1e-4)
    with pytest.raises(ParameterError, match="name"):
        input_range("pue2")
    with pytest.raises(ParameterError, match="containing"):
        input_row("pue", "Mars")


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("change, param", [
    (dict(pue=0.9), "pue"), (dict(salvage_fraction=1.0), "salvage_fraction"),
    (dict(depreciation_years=0), "depreciation_years"),
    (dict(electricity_usd_kwh=-0.1), "electricity_usd_kwh"),
    (dict(server_power_ratio=0.5), "server_power_ratio"),
    (dict(gpu_power_fraction=0), "gpu_power_fraction"), (dict(staff_fte=-1), "staff_fte"),
    (dict(gpus_per_server=0), "gpus_per_server"), (dict(tdp_w=0), "tdp_w"),
    (dict(capex_per_server_usd=math.nan), "capex_per_server_usd"),
])
def test_bad_hardware_inputs_name_the_parameter(change, param):
    with pytest.raises(ParameterError) as err:
        hardware(**change)
    assert err.value.param == param and param in str(err.value)


def test_other_bad_inputs():
    with pytest.raises(ParameterError, match="output_tokens"):
        scenario(traffic=TokenMix(1e9, 0))
    with pytest.raises(ParameterError, match="usd_per_1m_output"):
        card(1, 1, -1)
    with pytest.raises(ParameterError, match="billed_fraction"):
        Cloud(3.0, billed_fraction=0)
    with pytest.raises(ParameterError, match="peak_to_average"):
        scenario(peak_to_average=0.5)
    with pytest.raises(ParameterError, match="provenance"):
        Throughput(500, 100, 1.0, 0.3, 1, " ")
    with pytest.raises(ParameterError, match="path"):
        scenario().with_value("hardware.colour", 1)
    with pytest.raises(ParameterError, match="path"):
        scenario().value("nope")
    with pytest.raises(ParameterError, match="servers"):
        hardware().month(-1)


# --- sensitivity ----------------------------------------------------------------------------


def test_tornado_orders_by_effect_and_derives_the_pue_bar():
    s = scenario(hardware=hardware(server_power_ratio=1.5, colocation_usd_kw_month=170))
    swings = sourced_swings(s)
    assert {w.path for w in swings} >= {"hardware.pue", "hardware.electricity_usd_kwh",
                                        "hardware.capex_per_server_usd"}
    bars = tornado(s, swings)
    effects = [b.effect for b in bars]
    assert effects == sorted(effects, reverse=True)
    # PUE from 1.09 to 1.54: 8.4 kW x 0.45 x 730 h x $0.10 = $275.94 a month.
    pue = next(b for b in bars if b.swing.path == "hardware.pue")
    assert pue.effect == pytest.approx(8.4 * 0.45 * 730 * 0.10)
    # The largest: a $270,000 server written off over 3 years (7,500 a month) or 6 (3,750):
    # $3,750. Next, its price from $199,000 to $317,000 over 60 months: $1,966.67.
    assert bars[0].swing.path == "hardware.depreciation_years"
    assert bars[0].effect == pytest.approx(270_000 / 36 - 270_000 / 72)
    assert bars[1].swing.path == "hardware.capex_per_server_usd"
    assert bars[1].effect == pytest.approx((317_000 - 199_000) / 60)
    assert all(b.base == pytest.approx(s.costs().self_minus_api_usd) for b in bars)


def test_tornado_on_the_breakeven_puts_never_first():
    # Near the edge (a server saves $362 a month against the API): the dearest electricity,
    # the dearest rent, the shortest life or the dearest server turn the answer to "never";
    # those bars come first, in the order given, then the finite ones by size.
    s = scenario(api=card(0.042, 0.0042, 0.21), hardware=hardware(
        server_power_ratio=1.8214, colocation_usd_kw_month=170))
    assert s.breakeven().margin_usd_per_server_month == pytest.approx(361.62, abs=0.01)
    bars = tornado(s, sourced_swings(s), metric="breakeven_tokens_month")
    assert [b.swing.path for b in bars] == [
        "hardware.electricity_usd_kwh", "hardware.colocation_usd_kw_month",
        "hardware.depreciation_years", "hardware.capex_per_server_usd",
        "hardware.server_power_ratio", "hardware.pue", "hardware.gpu_power_fraction"]
    assert math.isinf(bars[0].at_high) and math.isinf(bars[2].at_low)
    ax = plot_tornado(bars, metric="breakeven_tokens_month")
    assert len(ax.patches) == 2 * len(bars)
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == bars[0].swing.label


def test_tornado_rejects_unknown_metric_and_path():
    with pytest.raises(ParameterError, match="metric"):
        tornado(scenario(), [], metric="profit")
    with pytest.raises(ParameterError, match="path"):
        tornado(scenario(), [Swing("hardware.nope", 0, 1, "x", "test")])
    with pytest.raises(ParameterError, match="low"):
        Swing("hardware.pue", 2, 1, "PUE", "test")


def test_widget_reports_and_reacts_headless():
    s = scenario(cloud=Cloud(3.50))
    assert "API:" in tco_report(s) and "payback vs cloud" in tco_report(s)
    box = tco_widget(s)
    assert "5,190" in box.report.value and "1 server(s)" in box.report.value
    box.controls["traffic"].value = s.traffic.total_tokens * 100
    assert box.scenario().traffic.total_tokens == pytest.approx(1.2e11, rel=1e-2)
    assert "519,000" in box.report.value and "8 GPU(s) needed" in box.report.value
    box.controls["hardware.pue"].value = 1.5
    assert box.scenario().hardware.pue == pytest.approx(1.5)


def test_tornado_swings_whole_price_cards():
    # Two API cards for the same traffic: $5,190 at the base card, and at a card of half the
    # prices $2,595: the monthly difference moves by $2,595.
    s = scenario()
    half = card(1.5, 0.15, 7.5)
    swing = Swing("api", half, API, "API card", "test", low_label="half", high_label="base")
    assert not swing.numeric and swing.end_labels() == ("half", "base")
    (bar,) = tornado(s, [swing])
    assert bar.effect == pytest.approx(2595)
    box = tco_widget(s, [swing])          # the widget leaves non-numeric swings out
    assert set(box.controls) == {"traffic"}


def test_cost_vs_volume_plot_draws_steps_and_crossings():
    s = step_scenario()
    ax = plot_cost_vs_volume(s, max_tokens_month=2e10)
    api, self_hosted = ax.lines[:2]
    # The API line ends at 2e10 tokens x $1e-6 = $20,000; the self-hosted side needs
    # ceil(2e10 / 2.628e9) = 8 servers: 5,000 + 8 x 1,200 = $14,600.
    assert api.get_ydata()[-1] == pytest.approx(20_000)
    assert self_hosted.get_ydata()[-1] == pytest.approx(14_600)
    crossings = [line for line in ax.lines[2:] if line.get_linestyle() == ":"]
    assert len(crossings) == 3
    never = scenario(api=card(0.02, 0.002, 0.05))
    assert "never" in plot_cost_vs_volume(never).get_title()
