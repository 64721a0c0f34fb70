"""The physical KV blocks and their free queue, after vLLM v1's ``BlockPool`` (chapter 3.1).

Every block is in exactly one of three states: owned (``ref_cnt > 0``), free and still holding
a cached prefix (``ref_cnt == 0`` and a hash), or free and empty. Free blocks sit in a doubly
linked queue whose order is also the eviction order: a freed block goes to the tail, new blocks
come from the head, so the block reused last is the one freed longest ago (LRU). Taking from
the head, appending to the tail and removing from the middle (a cache hit on a free block)
are all O(1); the seed tutorial's ``list.pop(0)`` is O(n).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from labkit.kvcache.hashing import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV blocks of one GPU, with reference counts and the prefix-cache index (ch. 3.1)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # hash value -> block holding that prefix
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of blocks owned by requests: vLLM's ``kv_cache_usage_perc`` / 100."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached prefixes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding exactly this prefix, if cached; tokens are compared too."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:  # a hash collision is a miss
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` now holds the full block ``block_hash`` names."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.value in self.cached:  # same prefix computed twice: keep the first
            return
        block.block_hash = block_hash
        self.cached[block_hash.value] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks nobody holds join the tail of the queue.

        Callers pass a request's blocks tail first, so its last blocks are evicted first and
        the shared beginning of a prompt stays cached longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash.value]
            block.block_hash = None
            self.num_evictions += 1
