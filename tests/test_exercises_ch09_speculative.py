"""Chapter 9 (speculative decoding) exercise checks: right answers pass, worked out by hand;
the usual mistakes are named; bad exercise parameters are refused by name."""

import numpy as np
import pytest

from labkit.checks import ParameterError
from labkit.engine.speculative import verify_sampled
from labkit.exercises import ch09_speculative as ex


def test_tokens_per_step():
    # a = 0.7, k = 4: 1 + 0.7 + 0.49 + 0.343 + 0.2401 = 2.7731 = (1 - 0.7^5) / 0.3.
    assert ex.check_tokens_per_step(2.7731)
    assert "model's own token" in repr(ex.check_tokens_per_step(1.7731))
    assert "independently" in repr(ex.check_tokens_per_step(3.8))        # 1 + 4 x 0.7
    assert "without end" in repr(ex.check_tokens_per_step(1 / 0.3))
    assert "all k drafts" in repr(ex.check_tokens_per_step(0.2401 * 5))
    assert "Not answered" in repr(ex.check_tokens_per_step(None))
    # Every draft kept: k + 1 tokens; none kept: the model's own token only.
    assert ex.check_tokens_per_step(4, acceptance_rate=1.0, num_speculative_tokens=3)
    assert ex.check_tokens_per_step(1, acceptance_rate=0.0, num_speculative_tokens=3)


def test_emitted_probability_is_the_models_own():
    # p = (0.5, 0.3, 0.2), draft 1: kept with 0.3; rejected with 0.7, then token 0 is drawn
    # with 0.5 / 0.7: 0.7 x 0.5 / 0.7 = 0.5, the model's own probability.
    assert ex.check_emitted_probability(0.5)
    assert "renormaliz" in repr(ex.check_emitted_probability(0.35))
    assert "weight by the chance" in repr(ex.check_emitted_probability(0.5 / 0.7))
    assert "as well" in repr(ex.check_emitted_probability(0.8))
    assert ex.check_emitted_probability(0.2, token=2)
    for kwargs, param in (({"probs": (0.5, 0.6)}, "probs"), ({"token": 1}, "token"),
                          ({"draft": 3}, "draft"),
                          ({"probs": (1.0, 0.0), "draft": 0, "token": 1}, "probs")):
        with pytest.raises(ParameterError) as err:
            ex.check_emitted_probability(0.5, **kwargs)
        assert err.value.param == param


def test_the_emitted_probability_is_what_the_engines_verifier_does():
    # The same position verified 20,000 times by the engine's rejection sampler (seeded).
    # Within 0.5 %: the standard error of 20,000 draws at p = 0.5 is 0.35 %, and the seed fixes
    # the draws.
    probs = np.array([0.5, 0.3, 0.2])
    rng = np.random.default_rng(0)
    emitted = [verify_sampled([1], [probs, probs], rng)[0] for _ in range(20_000)]
    assert ex.check_emitted_probability(emitted.count(0) / len(emitted), probs=tuple(probs))


def test_speedup():
    # 2.8 tokens a step, 24 ms where a plain step takes 20: 2.8 x 20 / 24 = 2.3333.
    assert ex.check_speedup(2.3333)
    assert "cost nothing" in repr(ex.check_speedup(2.8))
    assert "wrong way round" in repr(ex.check_speedup(3.36))
    assert "model's own token" in repr(ex.check_speedup(1.5))
    # Compute-bound: k + 1 = 5 tokens cost 5x the time: no gain, at best.
    assert ex.check_speedup(1.0, tokens_per_step=2.8, plain_step_ms=10, verify_step_ms=28)
    with pytest.raises(ParameterError) as err:
        ex.check_speedup(1.0, tokens_per_step=0.5)
    assert err.value.param == "tokens_per_step"


def test_acceptance_rate():
    # 120 steps with drafts, 480 draft tokens, 336 accepted: 336 / 480 = 0.7.
    counts = {"num_drafts": 120, "num_draft_tokens": 480, "num_accepted_tokens": 336}
    assert ex.check_acceptance_rate(0.7, **counts)
    assert "num_drafts" in repr(ex.check_acceptance_rate(2.8, **counts))
    assert "mean acceptance length" in repr(ex.check_acceptance_rate(3.8, **counts))
    assert "rejected share" in repr(ex.check_acceptance_rate(0.3, **counts))
    with pytest.raises(ParameterError) as err:
        ex.check_acceptance_rate(0.7, 0, 0, 0)
    assert err.value.param == "num_draft_tokens"
