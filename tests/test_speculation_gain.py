"""What speculation buys at scale: the papers' tokens-per-step formula, by hand and by Monte
Carlo, and chapter 1's roofline deciding when it pays."""

import numpy as np
import pytest

from labkit.checks import ParameterError
from labkit.hardware import decode_compute_bound_batch
from labkit.simulate.speculation import expected_tokens_per_step, speculative_decode_gain


def test_expected_tokens_per_step_by_hand():
    assert expected_tokens_per_step(0.0, 4) == 1  # every first draft rejected: one token
    assert expected_tokens_per_step(1.0, 4) == 5  # every draft kept, plus the model's token
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)  # 1 + 1/2 + 1/4 + 1/8
    # Leviathan et al. 2023 (figure 2's curve): alpha 0.8, gamma 4 gives (1 - 0.8^5) / 0.2.
    assert expected_tokens_per_step(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)


@pytest.mark.parametrize("alpha, k", [(0.3, 2), (0.7, 5), (0.9, 8)])
def test_expected_tokens_per_step_by_monte_carlo(alpha, k):
    """Flip a coin per draft until the first rejection: the mean emitted tokens, over
    200,000 seeded steps, within 4 standard errors of the formula."""
    rng = np.random.default_rng(0)
    accepted = rng.random((200_000, k)) < alpha
    run = np.where(accepted.all(axis=1), k, np.argmin(accepted, axis=1))  # first rejection
    tokens = run + 1
    assert abs(tokens.mean() - expected_tokens_per_step(alpha, k)) <= 4 * tokens.std() / np.sqrt(
        len(tokens))


def test_bad_input_is_named():
    with pytest.raises(ParameterError, match="acceptance_rate"):
        expected_tokens_per_step(1.5, 3)
    with pytest.raises(ParameterError, match="num_speculative_tokens"):
        expected_tokens_per_step(0.5, 0)
    with pytest.raises(ParameterError, match="draft_cost"):
        speculative_decode_gain("Llama-3-8B", "H100 SXM", 1, 1024, 3, 0.5, draft_cost=-1)
    with pytest.raises(ParameterError, match="batch_size"):
        speculative_decode_gain("Llama-3-8B", "H100 SXM", 0, 1024, 3, 0.5)


def test_it_pays_at_batch_one_and_not_when_compute_bound():
    """At batch 1 the step is memory-bound: verifying 4 drafts costs about one decode step,
    and the speed-up is nearly the tokens per step. With short contexts, far past the batch
    where decode turns compute-bound, every extra token costs its FLOPs and speculation
    loses."""
    k, alpha = 4, 0.6
    one = speculative_decode_gain("Llama-3-8B", "H100 SXM", 1, 128, k, alpha)
    assert one.plain.bound == one.verify.bound == "memory"
    assert one.step_time_ratio < 1.01
    assert one.speedup == pytest.approx(one.tokens_per_step, rel=0.01)
    knee = decode_compute_bound_batch("Llama-3-8B", "H100 SXM", 128)
    big = speculative_decode_gain("Llama-3-8B", "H100 SXM", 4 * knee, 128, k, alpha)
    assert big.plain.bound == big.verify.bound == "compute"
    assert big.step_time_ratio == pytest.approx(k + 1, rel=0.02)  # time follows the tokens
    assert big.speedup < 1


def test_the_gain_shrinks_as_the_batch_grows_with_short_contexts():
    gains = [speculative_decode_gain("Llama-3-8B", "H100 SXM", b, 128, 3, 0.7).speedup
             for b in (1, 4, 16, 64, 256, 1024)]
    assert gains == sorted(gains, reverse=True) and gains[-1] < 1 < gains[0]


def test_long_contexts_keep_it_paying_at_large_batches():
    """At 4,096 tokens of context the KV reads dominate every step: no batch makes decode
    compute-bound, and speculation still pays at batch 256 (MagicDec's observation)."""
    assert decode_compute_bound_batch("Llama-3-8B", "H100 SXM", 4096) is None
    gain = speculative_decode_gain("Llama-3-8B", "H100 SXM", 256, 4096, 3, 0.7)
    assert gain.verify.bound == "memory"
    assert gain.speedup > 0.95 * gain.tokens_per_step > 1


def test_a_draft_model_costs_its_share():
    free = speculative_decode_gain("Llama-3-8B", "H100 SXM", 1, 1024, 4, 0.8)
    drafted = speculative_decode_gain("Llama-3-8B", "H100 SXM", 1, 1024, 4, 0.8,
                                      draft_cost=0.4)
    assert drafted.step_time_ratio == pytest.approx(free.step_time_ratio + 0.4)
    assert drafted.tokens_per_s < free.tokens_per_s
