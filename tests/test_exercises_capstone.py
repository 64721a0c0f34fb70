"""The capstone lab's checks: the maximum concurrency vLLM prints, worked by hand, and the
checks it borrows from chapters 2 and 8 are the same functions."""

import pytest

from labkit.checks import ParameterError
from labkit.exercises import capstone as ex
from labkit.exercises import ch01, ch02, ch08_deploy


def test_max_concurrency():
    # vLLM on CPU with 1 GiB of KV space for the tiny model: 2,097,152 tokens over requests of
    # 1,024 tokens is 2,048 of them; a cache of 3,000 tokens holds 2.93 requests of 1,024.
    assert ex.check_max_concurrency(2048, kv_tokens=2_097_152, max_model_len=1024)
    assert ex.check_max_concurrency(2.93, kv_tokens=3000, max_model_len=1024)
    assert "rounded down" in repr(ex.check_max_concurrency(2, kv_tokens=3000,
                                                           max_model_len=1024))
    assert "other way round" in repr(ex.check_max_concurrency(1024 / 3000, kv_tokens=3000,
                                                              max_model_len=1024))
    # When the cache holds whole requests, rounding down is no mistake to name.
    assert "rounded" not in repr(ex.check_max_concurrency(3, kv_tokens=2048,
                                                          max_model_len=1024))
    with pytest.raises(ParameterError, match="kv_tokens"):
        ex.check_max_concurrency(1, kv_tokens=0, max_model_len=1024)


def test_the_borrowed_checks_are_the_chapters_own():
    assert ex.check_tpot_ms is ch02.check_tpot_ms
    assert ex.check_kv_bytes_per_token is ch02.check_kv_bytes_per_token
    assert ex.check_failure_threshold is ch08_deploy.check_failure_threshold
    assert ex.check_decode_tokens_per_s is ch01.check_decode_tokens_per_s
