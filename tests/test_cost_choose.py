"""The tutorial's decision tree, priced (chapter 1.6): every pick is a real option at a real,
dated price, and each budget's rule holds."""

import pytest

from labkit.checks import ParameterError
from labkit.cost.choose import BUDGETS, priced_choices
from labkit.cost.prices import gpu_hourly_price
from labkit.hardware import get_gpu

MODELS = ["Qwen2.5-7B", "Qwen2.5-14B", "CodeLlama-34B", "Llama-3-70B", "Llama-3.1-405B"]


def test_an_option_priced_by_hand():
    # Llama-3-8B on one RTX 4090: the table's three on-demand offers are $0.29 (OpenRelay),
    # $0.34 and $0.74 (RunPod): the median is $0.34 an hour.
    choices = priced_choices("Llama-3-8B", max_model_len=4096, concurrency=1)
    one = next(o for o in choices.options
               if o.option.gpu == "RTX 4090" and o.option.num_gpus == 1)
    assert one.usd_per_hour == pytest.approx(0.34) and one.consumer
    # At its decode bound every paid second: $0.34 / (tok/s x 3600) per token.
    assert one.usd_per_1m_tokens_at_bound == pytest.approx(
        0.34 / (one.option.decode_tok_s * 3600) * 1e6)


@pytest.mark.parametrize("model", MODELS)
def test_each_budget_follows_its_rule(model):
    choices = priced_choices(model, max_model_len=8192, concurrency=16)
    assert choices.options, model
    hours = [o.usd_per_hour for o in choices.options]
    assert hours == sorted(hours)
    for o in choices.options:
        price = gpu_hourly_price(o.option.gpu, num_gpus=o.option.num_gpus)
        assert o.usd_per_hour == pytest.approx(price.usd_per_gpu_hour * o.option.num_gpus)
        assert o.consumer == get_gpu(o.option.gpu).notes.startswith("GeForce")
    cheapest, datacenter, fastest = (choices.pick(b) for b in BUDGETS)
    assert cheapest.usd_per_hour == min(hours)
    if datacenter is not None:
        assert not datacenter.consumer
        assert datacenter.usd_per_hour == min(o.usd_per_hour for o in choices.options
                                              if not o.consumer)
    assert fastest.option.decode_tok_s == max(o.option.decode_tok_s for o in choices.options)


def test_gpus_without_a_price_are_counted_not_guessed():
    # The table prices no MI300X: its options are listed as unpriced, never priced.
    choices = priced_choices("Llama-3-70B", max_model_len=8192, concurrency=16)
    assert any(r.gpu == "MI300X" for r in choices.unpriced)
    assert all(o.option.gpu != "MI300X" for o in choices.options)


def test_a_405b_model_leaves_consumer_cards_out():
    # 405B parameters do not fit eight 24 GiB cards at any precision.
    choices = priced_choices("Llama-3.1-405B", max_model_len=8192, concurrency=16)
    assert not any(o.consumer for o in choices.options)
    assert choices.pick("lowest cost") is choices.pick("data-center GPUs")


def test_an_unknown_budget_is_named():
    choices = priced_choices("Qwen2.5-7B", max_model_len=4096, concurrency=1)
    with pytest.raises(ParameterError) as err:
        choices.pick("cheap")
    assert err.value.param == "budget" and "lowest cost" in str(err.value)
