"""Exercise checks: right answers pass, known mistakes are named, nothing is revealed."""

import pytest

from labkit.grading import check_number
from labkit.hardware import decode_step, plan_kv_cache
from labkit.exercises.ch01 import (
    check_decode_tokens_per_s,
    check_kv_bytes_per_token,
    check_max_concurrency,
    check_weights_gib,
)


def test_check_number_basics():
    assert check_number(10.05, 10, what="x")
    assert not check_number(None, 10, what="x")
    assert "Not answered yet" in repr(check_number(None, 10, what="x"))
    assert "finite number" in repr(check_number("ten", 10, what="x"))
    assert "finite number" in repr(check_number(True, 1, what="x"))
    assert "2x the expected" in repr(check_number(20, 10, what="x"))
    assert "used the heads" in repr(check_number(30, 10, what="x", mistakes={"used the heads": 30}))


def test_unit_slips_are_named():
    gib = 10.0
    assert "GB (1e9 bytes)" in repr(check_number(gib * 2**30 / 1e9, gib, what="w", rel_tol=1e-3))
    assert "1024" in repr(check_number(gib * 1024, gib, what="w"))


def test_wrong_answers_do_not_reveal_the_expected_value():
    feedback = repr(check_kv_bytes_per_token(1))
    assert "327" not in feedback


def test_kv_exercise():
    assert check_kv_bytes_per_token(327_680)
    assert "KV heads" in repr(check_kv_bytes_per_token(2 * 80 * 64 * 128 * 2))
    assert "factor 2" in repr(check_kv_bytes_per_token(163_840))
    assert "one layer" in repr(check_kv_bytes_per_token(4096))


def test_weights_exercise():
    assert check_weights_gib(5.33)
    assert "embedding and LM head" in repr(check_weights_gib(3.88))
    assert check_weights_gib(14.96, weight_dtype="bf16")


def test_concurrency_exercise():
    plan = plan_kv_cache("Llama-3-8B", "L40S", max_model_len=8192)
    assert check_max_concurrency(plan.max_concurrency)
    assert "gpu_memory_utilization" in repr(check_max_concurrency(
        plan_kv_cache("Llama-3-8B", "L40S", max_model_len=8192,
                      gpu_memory_utilization=1.0).max_concurrency))


def test_decode_exercise():
    step = decode_step("Llama-3-8B", "H100 SXM", 1, 1024)
    assert check_decode_tokens_per_s(step.tokens_per_s)
    assert "compute roof" in repr(check_decode_tokens_per_s(1 / step.compute_s))


@pytest.mark.parametrize("check", [check_kv_bytes_per_token, check_weights_gib,
                                   check_max_concurrency, check_decode_tokens_per_s])
def test_every_check_handles_unanswered(check):
    assert not check(None)
