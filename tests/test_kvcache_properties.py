"""Random long sequences of allocate/append/fork/free/evict never corrupt the cache."""

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.kvcache import BlockPool, KVCacheManager, hash_request_blocks
from labkit.units import cdiv

BLOCK = 4
VOCAB = 3  # a tiny vocabulary makes shared prefixes and cache hits frequent


class KVCacheMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash)

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BLOCK, hash_fn=self.hash_fn)
        self.tokens: dict[str, list[int]] = {}  # what each live request has slots for
        # block id -> every token up to the end of that block, as last written: what a cache
        # hit on the block really serves. Kept by the test, independent of the hashes.
        self.prefix_in_block: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def record_contents(self, rid):
        seq = self.tokens[rid]
        for i, block_id in enumerate(self.kv.get_block_ids(rid)[: len(seq) // BLOCK]):
            self.prefix_in_block[block_id] = tuple(seq[:(i + 1) * BLOCK])

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
          own_hashes=st.booleans())
    def admit(self, prompt, own_hashes):
        rid = f"r{self.next_id}"
        self.next_id += 1
        block_hashes = hash_request_blocks(prompt, BLOCK, self.hash_fn)
        blocks, hit = self.kv.get_computed_blocks(block_hashes, len(prompt))
        assert hit < len(prompt) and hit % BLOCK == 0
        for i, block in enumerate(blocks):  # a hit serves exactly this prompt's whole prefix
            assert self.prefix_in_block[block.block_id] == tuple(prompt[:(i + 1) * BLOCK])
        # The request may keep its own hash list (as a scheduler's Request does) or not.
        if self.kv.allocate_slots(rid, prompt, len(prompt) - hit, blocks,
                                  block_hashes if own_hashes else None) is not None:
            self.tokens[rid] = list(prompt)
            self.record_contents(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        seq = self.tokens[rid]
        seq.append(token)  # grown in place, rolled back below if no block is free
        if self.kv.allocate_slots(rid, seq, 1) is None:
            seq.pop()
        else:
            self.record_contents(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1),
          drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          num_accepted=st.integers(0, 9))
    def speculate(self, data, token, drafts, num_accepted):
        """A decode step that verifies drafts: a slot for the new token and lookahead slots
        for the drafts, then the slots of the rejected ones handed back (trim_slots)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        seq = self.tokens[rid]
        seq.append(token)
        if self.kv.allocate_slots(rid, seq, 1, num_lookahead_tokens=len(drafts)) is None:
            seq.pop()
            return
        assert self.kv.req_num_slots[rid] == len(seq) + len(drafts)
        seq.extend(drafts[:min(num_accepted, len(drafts))])
        self.kv.trim_slots(rid, seq, len(seq))
        self.record_contents(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"r{self.next_id}"
        self.next_id += 1
        if self.kv.fork(parent, child) is not None:
            self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid]

    @invariant()
    def blocks_are_owned_exactly_once_or_free(self):
        pool = self.kv.block_pool
        owners: dict[int, int] = {}
        for rid, blocks in self.kv.req_to_blocks.items():
            assert len(blocks) == cdiv(self.kv.req_num_slots[rid], BLOCK)
            assert self.kv.get_block_ids(rid) == [b.block_id for b in blocks]
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        free = {b.block_id for b in pool.free_queue}
        assert len(free) == pool.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0)  # exact reference counts
            assert (block.block_id in free) == (block.ref_cnt == 0)  # no leak, no double use
        # within one request, no block appears twice
        for blocks in self.kv.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks)

    @invariant()
    def cached_prefixes_are_correct(self):
        for value, block in self.kv.block_pool.cached.items():
            assert block.block_hash.value == value
            tokens = self.prefix_in_block[block.block_id]
            assert block.block_hash.token_ids == tokens[-BLOCK:]
        for rid, seq in self.tokens.items():
            assert self.kv.req_block_hashes[rid][: len(seq) // BLOCK] == hash_request_blocks(
                seq, BLOCK, self.hash_fn)
            for i, block in enumerate(self.kv.req_to_blocks[rid]):
                if block.block_hash is not None:  # a cached block holds this request's tokens
                    assert block.block_hash.token_ids == tuple(seq[i * BLOCK:(i + 1) * BLOCK])


class CollidingKVCacheMachine(KVCacheMachine):
    """The same, with a hash that ignores the parent and has four values: collisions
    everywhere, which must only ever cost hits, never serve a wrong prefix."""

    hash_fn = staticmethod(lambda key: hash(key[1]) % 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=24),
                          st.integers(0, 6), st.integers(0, 6), st.booleans()),
                min_size=1, max_size=12),
       st.sampled_from([hash, lambda key: hash(key[1]) % 4]))
def test_caching_a_run_of_blocks_is_caching_them_one_by_one(sequences, hash_fn):
    """``cache_full_blocks`` against ``cache_block`` in a loop, on two pools taken through
    the same sequences (some freed at once, so later ones evict): the same cache entries,
    block by block, with colliding hashes too."""
    bulk, single = BlockPool(16), BlockPool(16)
    for tokens, first, length, free in sequences:
        hashes = hash_request_blocks(tokens, 2, hash_fn)
        first = min(first, len(hashes))
        stop = min(first + length, len(hashes))
        taken = []
        for pool in (bulk, single):
            if len(hashes) > pool.num_free_blocks:
                break
            taken.append(pool.get_new_blocks(len(hashes)))
        if len(taken) < 2:
            continue
        bulk.cache_full_blocks(taken[0], hashes, first, stop)
        for i in range(first, stop):
            single.cache_block(taken[1][i], hashes[i], taken[1][i - 1] if i else None)
        if free:
            bulk.free_blocks(reversed(taken[0]))
            single.free_blocks(reversed(taken[1]))
        assert ({v: b.block_id for v, b in bulk.cached.items()}
                == {v: b.block_id for v, b in single.cached.items()})
        assert ([(b.block_hash, b.parent_content_id, b.ref_cnt) for b in bulk.blocks]
                == [(b.block_hash, b.parent_content_id, b.ref_cnt) for b in single.blocks])


for machine in (KVCacheMachine, CollidingKVCacheMachine):
    machine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                         deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
TestCollidingKVCacheMachine = CollidingKVCacheMachine.TestCase
