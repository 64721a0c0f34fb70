"""The capstone lab's checks: the maximum concurrency vLLM prints, worked by hand, and the
checks it borrows from chapters 2 and 8 are the same functions."""

import pytest

from labkit.checks import ParameterError
from labkit.exercises import capstone as ex
from labkit.exercises import ch01, ch02, ch08_deploy


def test_max_concurrency():
    # vLLM on CPU with 1 GiB of KV space for the tiny model: 2,097,152 tokens in blocks of
    # 128 over requests of 1,024 tokens (8 blocks each) is 16,384 / 8 = 2,048 of them.
    assert ex.check_max_concurrency(2048, kv_tokens=2_097_152, max_model_len=1024,
                                    block_size=128)
    # 3,000 tokens in blocks of 16 are 187 blocks (the last 8 tokens make no block); a
    # request of 1,000 tokens takes 63 blocks (1,008 tokens): 187 / 63 = 2.968 requests,
    # while tokens over tokens would say 3.0.
    assert ex.check_max_concurrency(2.968, kv_tokens=3000, max_model_len=1000, block_size=16)
    assert ex.check_max_concurrency(2.97, kv_tokens=3000, max_model_len=1000, block_size=16)
    assert "whole blocks" in repr(ex.check_max_concurrency(3.0, kv_tokens=3000,
                                                           max_model_len=1000, block_size=16))
    assert "rounded down" in repr(ex.check_max_concurrency(2, kv_tokens=3000,
                                                           max_model_len=1000, block_size=16))
    assert "other way round" in repr(ex.check_max_concurrency(63 / 187, kv_tokens=3000,
                                                              max_model_len=1000,
                                                              block_size=16))
    # When the cache holds whole requests, rounding down is no mistake to name, and neither
    # is dividing tokens by tokens when requests are whole blocks.
    whole = repr(ex.check_max_concurrency(3, kv_tokens=3072, max_model_len=1024, block_size=16))
    assert "rounded" not in whole and "whole blocks" not in whole
    assert ex.check_max_concurrency(3, kv_tokens=3072, max_model_len=1024, block_size=16)
    with pytest.raises(ParameterError, match="kv_tokens"):
        ex.check_max_concurrency(1, kv_tokens=0, max_model_len=1024, block_size=16)
    with pytest.raises(ParameterError, match="block_size"):
        ex.check_max_concurrency(1, kv_tokens=1024, max_model_len=1024, block_size=0)


def test_max_concurrency_is_vllms_rule():
    # The check's expected value is labkit.hardware.max_concurrency, which tests/test_kv_budget
    # holds to vLLM's get_max_concurrency_for_kv_cache_config.
    from labkit.hardware import max_concurrency
    for tokens, length, block in [(5000, 777, 16), (2_097_152, 1000, 128), (4096, 17, 32)]:
        assert ex.check_max_concurrency(max_concurrency(tokens // block, block, length),
                                        kv_tokens=tokens, max_model_len=length,
                                        block_size=block)


def test_the_borrowed_checks_are_the_chapters_own():
    assert ex.check_tpot_ms is ch02.check_tpot_ms
    assert ex.check_kv_bytes_per_token is ch02.check_kv_bytes_per_token
    assert ex.check_failure_threshold is ch08_deploy.check_failure_threshold
    assert ex.check_decode_tokens_per_s is ch01.check_decode_tokens_per_s
