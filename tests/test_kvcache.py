"""Paged KV cache: the free queue, prefix caching, the manager's verbs and their errors."""

import pytest

from labkit.kvcache import (BlockHasher, BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager,
                            hash_request_blocks, memory_waste)
from labkit.scheduling import Request, Scheduler, SchedulerConfig


def lookup(kv, token_ids):
    """The manager's cached prefix for ``token_ids``, hashed the way the manager hashes."""
    return kv.get_computed_blocks(
        hash_request_blocks(token_ids, kv.block_size, kv.block_hasher.hash_fn), len(token_ids))


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


def test_free_queue_takes_and_returns_runs_of_blocks_in_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft_n(0) == [] and queue.num_free_blocks == 6
    assert queue.popleft_n(2) == blocks[:2]
    assert [b.block_id for b in queue] == [2, 3, 4, 5] and queue.num_free_blocks == 4
    assert blocks[0].prev_free is None and blocks[1].next_free is None  # unlinked
    queue.append_n([blocks[1], blocks[0]])
    assert [b.block_id for b in queue] == [2, 3, 4, 5, 1, 0] and queue.num_free_blocks == 6
    with pytest.raises(ValueError, match="asked for 7 blocks, only 6 free"):
        queue.popleft_n(7)
    assert queue.popleft_n(6) == blocks[2:] + [blocks[1], blocks[0]]
    assert list(queue) == [] and queue.num_free_blocks == 0
    queue.append_n([blocks[3]])                  # an emptied queue takes blocks again
    queue.remove(blocks[3])
    assert list(queue) == [] and queue.num_free_blocks == 0


def test_freeing_a_block_too_often_still_queues_the_blocks_freed_before_it():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match=f"block {a.block_id} freed more often"):
        pool.free_blocks([c, a, b])
    assert [blk.block_id for blk in pool.free_queue] == [3, a.block_id, c.block_id]
    assert pool.num_free_blocks == 3 and b.ref_cnt == 1


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_request_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1].token_ids == b[1].token_ids and a[1] != b[1]
    assert hash_request_blocks([1, 2, 3], 4) == []  # no full block


def test_hasher_extends_a_list_block_by_block():
    hasher, hashes, tokens = BlockHasher(4), [], [1, 2, 3]
    hasher.extend(hashes, tokens)
    assert hashes == []
    tokens += [4, 5]
    hasher.extend(hashes, tokens)
    first = hashes[0]
    tokens += [6, 7, 8, 9]
    hasher.extend(hashes, tokens)
    assert hashes[0] is first and hashes == hash_request_blocks(tokens, 4)


def test_hasher_extends_with_the_tokens_after_its_blocks():
    tokens = list(range(11))
    hasher, hashes = BlockHasher(4), []
    hasher.extend(hashes, tokens[:6])            # one full block, two tokens past it
    hasher.extend_with(hashes, tokens[4:])       # those two and the rest: one more block
    assert hashes == hash_request_blocks(tokens, 4) and len(hashes) == 2


def test_prefix_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))                       # exactly two full blocks
    kv.allocate_slots("a", prompt, 8)
    kv.free("a")
    blocks, hit = lookup(kv, prompt)
    assert hit == 4 and len(blocks) == 1          # the last token must be recomputed
    blocks, hit = lookup(kv, prompt + [99])
    assert hit == 8


def test_freed_blocks_keep_their_hash_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 5)   # blocks 0, 1 full and cached; 2 partial
    kv.free("a")
    assert lookup(kv, [1, 2, 3, 4, 5])[1] == 4
    kv.allocate_slots("b", list(range(10, 18)), 8)   # needs all 4 blocks: evicts the cache
    assert kv.block_pool.num_evictions == 2
    kv.free("b")
    assert lookup(kv, [1, 2, 3, 4, 5])[1] == 0


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
    blocks, hit = lookup(kv, [1, 2, 3])
    new = kv.allocate_slots("b", [1, 2, 3], 3 - hit, blocks)
    assert blocks[0].ref_cnt == 1 and len(new) == 1
    assert kv.block_pool.num_free_blocks == 2


def test_hash_collision_is_a_miss_not_a_wrong_hit():
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_fn=lambda _: 42)  # every hash collides
    kv.allocate_slots("a", [1, 2, 3], 3)
    kv.free("a")
    assert lookup(kv, [1, 2, 3])[1] == 2
    assert lookup(kv, [7, 8, 9])[1] == 0


def tokens_only(key):
    """A hash that forgets the parent: equal blocks collide wherever they sit in a prompt."""
    return hash(key[1])


def test_equal_blocks_after_different_prefixes_do_not_match():
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_fn=tokens_only)
    kv.allocate_slots("a", [1, 2, 3, 4, 0], 5)
    kv.allocate_slots("b", [5, 6, 0], 3)
    blocks, hit = lookup(kv, [5, 6, 3, 4, 0])   # [3, 4] collides with a's second block
    assert hit == 2 and blocks[0].block_id == kv.get_block_ids("b")[0]


def test_a_reused_parent_block_never_vouches_for_its_old_child():
    # Freeing a parent before its child (the pool allows any order) lets the parent be reused
    # for another prefix while the child stays cached, still naming the parent's block id.
    old, new = (hash_request_blocks(t, 2, tokens_only) for t in ([1, 2, 3, 4], [5, 6, 3, 4]))
    assert new[1] == old[1]                      # same value, same tokens: only the past differs
    pool = BlockPool(2)
    parent, child = pool.get_new_blocks(2)
    pool.cache_block(parent, old[0], None)
    pool.cache_block(child, old[1], parent)
    pool.free_blocks([parent, child])
    reused, = pool.get_new_blocks(1)
    assert reused is parent and pool.get_cached_block(old[1], parent) is None
    pool.cache_block(reused, new[0], None)
    assert pool.get_cached_block(new[0], None) is reused
    assert pool.get_cached_block(new[1], reused) is None    # the stale child must not match
    assert pool.cached[old[1].value] is child               # it is still cached, unreachable


def test_10k_token_prompt_at_block_size_1_is_hashed_once_and_fully_cached():
    calls = 0

    def counting_hash(key):
        nonlocal calls
        calls += 1
        return hash(key)

    prompt = list(range(10_000))
    kv = KVCacheManager(num_blocks=10_001, block_size=1, hash_fn=counting_hash)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=10_000))
    first, second = Request("first", prompt, [7]), Request("second", prompt, [7])
    sched.add_request(first)
    assert calls == 10_000                      # the prompt, once, when the request arrives
    sched.update(sched.schedule(), 1.0)
    assert first.is_finished and calls == 10_001  # its output token filled one more block
    sched.add_request(second)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"second": 1}    # every prompt token but the last hit
    for _ in range(3):                                  # lookups read the request's hashes
        blocks, hit = kv.get_computed_blocks(second.block_hashes, second.num_tokens)
        assert hit == 9_999 and len(blocks) == 9_999
    assert calls == 20_001 and kv.prefix_cache_hits == 4 * 9_999  # no lookup hashed


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 5)
    blocks, hit = lookup(kv, [1, 2, 3, 4, 9])
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
    blocks, _ = lookup(kv, [1, 2, 3])
    with pytest.raises(ValueError, match="already has blocks"):
        kv.allocate_slots("a", [1, 2, 3, 4], 1, blocks)


def test_memory_waste_by_hand():
    # lengths 1, 16, 17 with blocks of 16: paged 16 + 16 + 32 = 64 slots, 34 used.
    waste = memory_waste([1, 16, 17], block_size=16, max_model_len=2048)
    assert (waste.used_tokens, waste.paged_tokens, waste.contiguous_tokens) == (34, 64, 3 * 2048)
    assert waste.paged_waste == pytest.approx(30 / 64)
    with pytest.raises(ValueError, match="max_model_len"):
        memory_waste([5000], 16, 2048)
