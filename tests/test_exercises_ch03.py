"""Chapter 3 exercise checks: right answers pass, the usual mistakes are named."""

import numpy as np

from labkit.exercises import ch03 as ex


def test_kv_cache_exercises():
    assert ex.check_blocks_needed(4) and "rounded down" in repr(ex.check_blocks_needed(3))
    assert ex.check_cached_prefix_tokens(96)
    assert "recomputed" in repr(ex.check_cached_prefix_tokens(96, prompt_len=96))
    assert "blocks, not tokens" in repr(ex.check_cached_prefix_tokens(6))
    lens = [1, 16, 17]
    assert ex.check_paged_waste(30 / 64, lens)
    assert "percentage" in repr(ex.check_paged_waste(100 * 30 / 64, lens))


def test_batching_exercises():
    lens = [10, 50, 5, 100, 3, 20, 8, 60, 15, 40]
    assert ex.check_static_steps(200, lens)
    assert "longest per batch" in repr(ex.check_static_steps(sum(lens), lens))
    assert ex.check_steps_to_first_token(3)
    assert not ex.check_steps_to_first_token(None)


def test_row_parallel_exercise_tells_what_is_off():
    def right(xs, ws, b):
        return sum(x @ w for x, w in zip(xs, ws, strict=True)) + b

    def bias_everywhere(xs, ws, b):
        return sum(x @ w + b for x, w in zip(xs, ws, strict=True))

    def no_bias(xs, ws, b):
        return sum(x @ w for x, w in zip(xs, ws, strict=True))

    assert ex.check_row_parallel(right)
    assert "every rank" in repr(ex.check_row_parallel(bias_everywhere))
    assert "bias is missing" in repr(ex.check_row_parallel(no_bias))
    assert "shape" in repr(ex.check_row_parallel(lambda xs, ws, b: np.zeros(3)))
    assert "Not answered" in repr(ex.check_row_parallel(None))


def test_communication_exercises():
    # 2 * 7 steps of 2 MB at 450 GB/s = 62.2 us.
    assert ex.check_ring_all_reduce_us(62.22)
    assert "two-direction" in repr(ex.check_ring_all_reduce_us(31.11))
    assert ex.check_decode_allreduce_bytes(80 * 2 * 8192 * 2)
    assert "two" in repr(ex.check_decode_allreduce_bytes(80 * 8192 * 2))
