"""Paged KV cache: the free queue, prefix caching, the manager's verbs and their errors."""

import pytest

from labkit.kvcache import (BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager,
                            hash_request_blocks, memory_waste)


def test_free_queue_pops_head_appends_tail_removes_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2] and queue.num_free_blocks == 4
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_request_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1].token_ids == b[1].token_ids and a[1] != b[1]
    assert hash_request_blocks([1, 2, 3], 4) == []  # no full block


def test_prefix_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))                       # exactly two full blocks
    kv.allocate_slots("a", prompt, 8)
    kv.free("a")
    blocks, hit = kv.get_computed_blocks(prompt)
    assert hit == 4 and len(blocks) == 1          # the last token must be recomputed
    blocks, hit = kv.get_computed_blocks(prompt + [99])
    assert hit == 8


def test_freed_blocks_keep_their_hash_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 5)   # blocks 0, 1 full and cached; 2 partial
    kv.free("a")
    assert kv.get_computed_blocks([1, 2, 3, 4, 5])[1] == 4
    kv.allocate_slots("b", list(range(10, 18)), 8)   # needs all 4 blocks: evicts the cache
    assert kv.block_pool.num_evictions == 2
    kv.free("b")
    assert kv.get_computed_blocks([1, 2, 3, 4, 5])[1] == 0


def test_eviction_order_is_lru_and_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4], 4)           # blocks 0, 1
    kv.allocate_slots("b", [5, 6, 7, 8], 4)           # blocks 2, 3
    kv.free("a")                                      # queue: 4, 5, 1, 0
    kv.free("b")                                      # queue: 4, 5, 1, 0, 3, 2
    assert [b.block_id for b in kv.block_pool.free_queue] == [4, 5, 1, 0, 3, 2]


def test_cache_hit_on_a_free_block_revives_it():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3], 3)
    kv.free("a")
    blocks, hit = kv.get_computed_blocks([1, 2, 3])
    new = kv.allocate_slots("b", [1, 2, 3], 3 - hit, blocks)
    assert blocks[0].ref_cnt == 1 and len(new) == 1
    assert kv.block_pool.num_free_blocks == 2


def test_hash_collision_is_a_miss_not_a_wrong_hit():
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_fn=lambda _: 42)  # every hash collides
    kv.allocate_slots("a", [1, 2, 3], 3)
    kv.free("a")
    assert kv.get_computed_blocks([1, 2, 3])[1] == 2
    assert kv.get_computed_blocks([7, 8, 9])[1] == 0


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 5)
    blocks, hit = kv.get_computed_blocks([1, 2, 3, 4, 9])
    kv.allocate_slots("b", [1, 2, 3, 4, 9], 5 - hit, blocks)
    assert kv.get_block_ids("a")[:2] == kv.get_block_ids("b")[:2]
    assert [b.ref_cnt for b in blocks] == [2, 2]
    kv.free("a")
    assert [b.ref_cnt for b in blocks] == [1, 1]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", list(range(6)), 6)
    copies = kv.fork("p", "c")
    parent, child = kv.get_block_ids("p"), kv.get_block_ids("c")
    assert parent[0] == child[0] and copies == [(parent[1], child[1])]
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("p", "c")


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", list(range(8)), 8)
    before = kv.block_pool.num_free_blocks
    assert kv.allocate_slots("b", list(range(100, 108)), 8) is None
    assert kv.block_pool.num_free_blocks == before and "b" not in kv.req_to_blocks


@pytest.mark.parametrize("call, match", [
    (lambda kv: kv.free("ghost"), "unknown request 'ghost'"),
    (lambda kv: kv.allocate_slots("x", [1] * 100, 100), "needs 25 blocks; the cache has 4"),
    (lambda kv: kv.allocate_slots("x", [1, 2], 3), "only 2 tokens are known"),
    (lambda kv: kv.allocate_slots("x", [1, 2], 0), "num_new_tokens must be a positive"),
    (lambda kv: KVCacheManager(4, 0), "block_size must be a positive"),
    (lambda kv: BlockPool(0), "num_blocks must be a positive"),
])
def test_misuse_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(KVCacheManager(num_blocks=4, block_size=4))


def test_taking_cached_blocks_twice_is_an_error():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    kv.allocate_slots("a", [1, 2, 3], 3)
    blocks, _ = kv.get_computed_blocks([1, 2, 3])
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots("a", [1, 2, 3, 4], 1, blocks)


def test_memory_waste_by_hand():
    # lengths 1, 16, 17 with blocks of 16: paged 16 + 16 + 32 = 64 slots, 34 used.
    waste = memory_waste([1, 16, 17], block_size=16, max_model_len=2048)
    assert (waste.used_tokens, waste.paged_tokens, waste.contiguous_tokens) == (34, 64, 3 * 2048)
    assert waste.paged_waste == pytest.approx(30 / 64)
    with pytest.raises(ValueError, match="max_model_len"):
        memory_waste([5000], 16, 2048)
