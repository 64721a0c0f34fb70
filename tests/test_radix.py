"""SGLang-style radix cache: matching, splitting, locking, LRU eviction; hit-rate replay."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache import RadixCache, prefix_hit_rates


def test_match_splits_an_edge_where_the_match_ends():
    cache = RadixCache(100)
    slots = cache.alloc(5)
    cache.insert([1, 2, 3, 4, 5], slots)
    got, node = cache.match_prefix([1, 2, 3, 9])
    assert got == slots[:3] and node.key == (1, 2, 3)
    assert list(node.children.values())[0].key == (4, 5)
    assert cache.insert([1, 2, 3, 9], slots[:3] + cache.alloc(1)) == 3


def test_locked_paths_survive_eviction_and_lru_goes_first():
    cache = RadixCache(6)
    cache.insert([1, 2], cache.alloc(2))
    cache.insert([3, 4], cache.alloc(2))
    cache.insert([5, 6], cache.alloc(2))
    _, locked = cache.match_prefix([1, 2])     # most recently used, and locked
    cache.inc_lock_ref(locked)
    assert (cache.evictable_size, cache.protected_size) == (4, 2)
    assert cache.alloc(3) is not None            # evicts [3, 4] then [5, 6]
    assert cache.match_prefix([1, 2])[0] and not cache.match_prefix([3, 4])[0]
    assert cache.alloc(2) is None                # only the locked path is left
    cache.dec_lock_ref(locked)
    with pytest.raises(ValueError, match="unlocked"):
        cache.dec_lock_ref(locked)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=25))
def test_tree_returns_exactly_the_slots_it_was_given(sequences):
    cache = RadixCache(10_000)
    stored: dict[tuple, list[int]] = {}
    for seq in sequences:
        matched, _ = cache.match_prefix(seq)
        new = cache.alloc(len(seq) - len(matched))
        already = cache.insert(seq, matched + new)
        assert already == len(matched)
        for i in range(1, len(seq) + 1):
            stored.setdefault(tuple(seq[:i]), (matched + new)[:i])
    for prefix, slots in stored.items():
        assert cache.match_prefix(list(prefix))[0] == slots
    assert cache.total_size + len(cache.free_slots) == cache.capacity


def test_radix_hits_to_the_token_hashed_blocks_to_the_block():
    rng = random.Random(0)
    system = [rng.randrange(100) for _ in range(37)]       # not a multiple of 16
    seqs = [system + [rng.randrange(100) for _ in range(20)] for _ in range(10)]
    rates = prefix_hit_rates(seqs, [len(s) - 5 for s in seqs], capacity_tokens=4096)
    # After the first request, the radix tree serves all 37 system tokens, the block cache
    # only the 32 in two full blocks.
    assert rates.radix == pytest.approx(9 * 37 / rates.prompt_tokens)
    assert rates.paged == pytest.approx(9 * 32 / rates.prompt_tokens)
