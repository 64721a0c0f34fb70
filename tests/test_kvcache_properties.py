"""Random long sequences of allocate/append/fork/free/evict never corrupt the cache."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.kvcache import KVCacheManager

BLOCK = 4
VOCAB = 3  # a tiny vocabulary makes shared prefixes and cache hits frequent


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BLOCK)
        self.tokens: dict[str, list[int]] = {}  # what each live request has slots for
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
    def admit(self, prompt):
        rid = f"r{self.next_id}"
        self.next_id += 1
        blocks, hit = self.kv.get_computed_blocks(prompt)
        assert hit < len(prompt) and hit % BLOCK == 0
        for block, start in zip(blocks, range(0, hit, BLOCK), strict=True):
            assert block.block_hash.token_ids == tuple(prompt[start:start + BLOCK])
        if self.kv.allocate_slots(rid, prompt, len(prompt) - hit, blocks) is not None:
            self.tokens[rid] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        seq = self.tokens[rid] + [token]
        if self.kv.allocate_slots(rid, seq, 1) is not None:
            self.tokens[rid] = seq

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
            assert len(blocks) == -(-self.kv.req_num_slots[rid] // BLOCK)
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
        for rid, seq in self.tokens.items():
            for i, block in enumerate(self.kv.req_to_blocks[rid]):
                if block.block_hash is not None:  # a cached block holds this request's tokens
                    assert block.block_hash.token_ids == tuple(seq[i * BLOCK:(i + 1) * BLOCK])


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                            deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
