"""Chapter 7's decision table: every factor has a sourced fact for every option."""

import pytest

from labkit.checks import ParameterError
from labkit.cost.tco import Cloud
from labkit.cost.tradeoffs import OPTIONS, factors, tradeoff, tradeoff_table, tradeoffs


def test_every_factor_has_one_fact_per_option():
    assert factors() == ["elasticity", "lead time", "data residency", "GPU availability",
                         "skills"]
    for factor in factors():
        rows = [t for t in tradeoffs() if t.factor == factor]
        assert sorted(t.option for t in rows) == sorted(OPTIONS), factor
    assert len(tradeoffs()) == len(factors()) * len(OPTIONS)


def test_the_table_cites_every_fact_and_keeps_dollars_out_of_math():
    table = tradeoff_table()
    assert table.count("\n") == 1 + len(factors())
    for row in tradeoffs():
        assert row.source in table and row.as_of in table
    assert "$" not in table.replace("\\$", "")


def test_the_lead_time_the_lab_uses():
    lead = tradeoff("lead time", "self-hosted")
    assert (lead.value, lead.unit) == (12, "weeks") and "12 weeks" in lead.fact
    assert all(t.value is None for t in tradeoffs() if t is not lead)


def test_bad_lookups_name_the_parameter():
    with pytest.raises(ParameterError) as err:
        tradeoff("lead time", "on-prem")
    assert err.value.param == "option"
    with pytest.raises(ParameterError) as err:
        tradeoff("latency", "api")
    assert err.value.param == "factor" and "elasticity" in str(err.value)


def test_a_bridge_is_billed_by_the_hour():
    # 8 GPUs (one instance) at $4 a GPU-hour for one week: 8 x 4 x 168 = $5,376.
    assert Cloud(4.0, 8).usd_for_hours(8, 168) == pytest.approx(5376)
    with pytest.raises(ParameterError, match="hours"):
        Cloud(4.0, 8).usd_for_hours(8, -1)
