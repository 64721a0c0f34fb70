"""The price tables of chapter 6 and their loader: every row sourced and dated, ranges,
overrides, API bills worked by hand."""

import math
import re

import pytest

from openai.types import CompletionUsage

from labkit.checks import ParameterError
from labkit.cost.prices import (HOURS_PER_MONTH, PRICING_MODELS, APIPrice, GPUPrice, TokenMix,
                                api_price, gpu_hourly_price, gpu_price_range, gpu_prices,
                                load_api_prices, load_gpu_prices, price_range_table)
from labkit.hardware import list_gpus

DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


def test_every_gpu_price_row_is_sourced_dated_and_names_a_known_gpu():
    names = {g.name for g in list_gpus()}
    rows = load_gpu_prices()
    assert len(rows) >= 20
    for row in rows:
        assert row.gpu in names
        assert row.pricing in PRICING_MODELS
        assert row.source.startswith("http"), row
        assert DATE.match(row.as_of) and "2024-01" <= row.as_of <= "2026-12-31", row
        assert row.usd_per_gpu_hour > 0


def test_prices_show_ranges_several_providers_per_gpu():
    for gpu in ("H100 SXM", "A100 80GB", "L40S", "H200 SXM"):
        spread = gpu_price_range(gpu)
        assert len({r.provider for r in spread.rows}) >= 3, gpu
        assert spread.spread > 1.2


def test_every_api_price_row_is_sourced_and_dated():
    rows = load_api_prices()
    assert len(rows) >= 5
    for row in rows:
        assert row.source.startswith("http") and DATE.match(row.as_of), row
        # Output costs at least what input costs on every card we hold.
        assert row.usd_per_1m_output >= row.usd_per_1m_input
        if row.usd_per_1m_cached_input is not None:
            assert row.usd_per_1m_cached_input <= row.usd_per_1m_input


def _row(provider, usd, min_gpus=1, gpu="H100 SXM", pricing="on_demand"):
    return GPUPrice(gpu, provider, pricing, usd, source="https://example.org/quote",
                    as_of="2026-12-01", min_gpus=min_gpus)


def test_price_range_low_median_high_worked_by_hand():
    odd = [_row("a", 4.0), _row("b", 1.0), _row("c", 2.0)]
    spread = gpu_price_range("H100 SXM", table=odd)
    assert (spread.low.provider, spread.median.provider, spread.high.provider) == ("b", "c", "a")
    assert spread.spread == 4.0
    even = odd + [_row("d", 3.0)]
    spread = gpu_price_range("H100 SXM", table=even)
    # Rows 1, 2, 3, 4: the median row is the cheaper middle one (a real offer), the
    # statistical median is (2 + 3) / 2.
    assert spread.median.usd_per_gpu_hour == 2.0
    assert spread.median_usd_per_gpu_hour == 2.5


def test_hourly_price_respects_the_instance_size():
    table = [_row("x", 3.0, min_gpus=1), _row("x", 2.5, min_gpus=8), _row("y", 9.0)]
    assert gpu_hourly_price("H100 SXM", "x", num_gpus=1, table=table).usd_per_gpu_hour == 3.0
    assert gpu_hourly_price("H100 SXM", "X", num_gpus=8, table=table).usd_per_gpu_hour == 2.5
    # No provider: the median of what one GPU can rent (3.0 and 9.0 -> the cheaper middle).
    assert gpu_hourly_price("H100 SXM", table=table).usd_per_gpu_hour == 3.0
    with pytest.raises(ParameterError, match="providers in the table: x, y"):
        gpu_hourly_price("H100 SXM", "z", table=table)


def test_default_table_lookups():
    lambda8 = gpu_hourly_price("H100 SXM", "Lambda", num_gpus=8)
    lambda1 = gpu_hourly_price("H100 SXM", "Lambda", num_gpus=1)
    assert lambda8.usd_per_gpu_hour <= lambda1.usd_per_gpu_hour
    assert "Lambda" in lambda8.citation() and lambda8.as_of in lambda8.citation()
    assert gpu_prices("H100 SXM", pricing="spot")
    assert gpu_prices("H100 SXM", pricing="capacity_block")
    assert "| H100 SXM |" in price_range_table()


@pytest.mark.parametrize("kwargs, param", [
    ({"pricing": "reserved"}, "pricing"),
    ({"usd_per_gpu_hour": 0.0}, "usd_per_gpu_hour"),
    ({"as_of": "Dec 2026"}, "as_of"),
    ({"source": " "}, "source"),
    ({"min_gpus": 0}, "min_gpus"),
])
def test_bad_price_rows_are_refused(kwargs, param):
    fields = {"gpu": "L40S", "provider": "p", "pricing": "on_demand", "usd_per_gpu_hour": 1.0,
              "source": "https://example.org", "as_of": "2026-12-01"} | kwargs
    with pytest.raises(ParameterError) as err:
        GPUPrice(**fields)
    assert err.value.param == param


def test_unknown_gpu_is_refused_not_priced_at_a_default():
    with pytest.raises(ValueError, match="unknown GPU"):
        _row("p", 1.0, gpu="H100-SXM5-ultra")
    with pytest.raises(ParameterError, match="pricing must be one of"):
        gpu_prices("L40S", pricing="monthly")


def _usage_mix(usage: CompletionUsage) -> TokenMix:
    return TokenMix(usage.prompt_tokens, usage.completion_tokens,
                    usage.prompt_tokens_details.cached_tokens)


def test_api_bill_follows_openai_usage_and_agrees_with_three_disjoint_counts():
    card = APIPrice("p", "m", 2.0, 0.5, 8.0, "https://example.org", "2026-12-01")
    # OpenAI's SDK object: prompt_tokens includes prompt_tokens_details.cached_tokens.
    usage = CompletionUsage(prompt_tokens=1_000_000, completion_tokens=200_000,
                            total_tokens=1_200_000,
                            prompt_tokens_details={"cached_tokens": 400_000})
    # The same month as three disjoint counts, priced by hand: 600k uncached prompt tokens,
    # 400k cached, 200k output: 600k x $2/M + 400k x $0.5/M + 200k x $8/M = 1.2 + 0.2 + 1.6.
    uncached, cached, output = 600_000, 400_000, 200_000
    by_hand = (uncached * 2.0 + cached * 0.5 + output * 8.0) / 1e6
    assert math.isclose(by_hand, 3.0)
    from_usage = card.cost_usd(_usage_mix(usage))
    from_disjoint = card.cost_usd(TokenMix(uncached + cached, output, cached))
    assert math.isclose(from_usage, 3.0) and math.isclose(from_disjoint, 3.0)
    assert _usage_mix(usage).total_tokens == usage.total_tokens
    # Without a cached price the cached tokens pay full price: 2.0 + 1.6
    no_cache = APIPrice("p", "m", 2.0, None, 8.0, "https://example.org", "2026-12-01")
    assert math.isclose(no_cache.cost_usd(_usage_mix(usage)), 3.6)


def test_cached_tokens_outside_the_prompt_tokens_are_refused():
    # Counting the cached tokens on top of the prompt tokens (disjoint counts passed as if
    # they were usage) is the mistake the convention prevents.
    with pytest.raises(ParameterError) as err:
        TokenMix(100, 10, cached_input_tokens=200)
    assert err.value.param == "cached_input_tokens"


def test_a_mix_scales_keeping_its_shares():
    mix = TokenMix(1e9, 2e8, 3e8).scaled_to(2.4e9)
    assert (mix.input_tokens, mix.output_tokens, mix.cached_input_tokens) == (2e9, 4e8, 6e8)


def test_api_price_lookup_and_error():
    card = api_price("together ai", "llama 3.1 8b instruct")
    assert card.usd_per_1m_output > card.usd_per_1m_input
    with pytest.raises(ParameterError, match="no API price"):
        api_price("nobody", "nothing")


def test_tables_can_be_replaced_by_your_own_rows():
    quote = GPUPrice("L40S", "my colo", "committed_3y", 0.55, source="quote from my colo",
                     as_of="2026-11", min_gpus=8)
    price = gpu_hourly_price("L40S", pricing="committed_3y", num_gpus=8, table=[quote])
    assert price.usd_per_gpu_hour == 0.55 and price.provider == "my colo"


def test_a_month_has_730_hours():
    # 365 days x 24 h / 12 months; the tutorial's 24 x 30 = 720 is 1.4 % short.
    assert HOURS_PER_MONTH == 730
