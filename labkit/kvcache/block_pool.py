"""The physical KV blocks and their free queue, after vLLM v1's ``BlockPool``
(:ref:`ch03-paged-attention`).

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

from labkit.checks import ParameterError, positive_int
from labkit.kvcache.hashing import BlockHash


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache.

    A block id names a place in memory, not what it holds: once a block is evicted, the same
    id holds other tokens. ``generation`` counts how often the block was handed out, so
    :attr:`content_id`, the pair of both, names one content and is never reused. A cached
    block records its parent's ``content_id`` (the block holding the prefix before it): when
    that parent is reused for another prefix, the child no longer matches any lookup.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_content_id: tuple[int, int] | None = None  # while cached; None for a first block
    generation: int = 0
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def content_id(self) -> tuple[int, int]:
        """``(block_id, generation)``: names what the block holds now."""
        return self.block_id, self.generation

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) popleft, append and remove, and
    ``popleft_n``/``append_n`` for a run of blocks (vLLM's ``FreeKVCacheBlockQueue``,
    ``vllm/v1/core/kv_cache_utils.py``, commit 001cabc)."""

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
            raise ParameterError(None, "popleft: no free blocks")
        # remove(), inlined: the hottest call of a long simulation.
        nxt = block.next_free
        self._head.next_free, nxt.prev_free = nxt, self._head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks, unlinked in one walk: the head is relinked once, not ``n``
        times, and no call per block."""
        if n > self.num_free_blocks:
            raise ParameterError("n", f"n: asked for {n} blocks, only {self.num_free_blocks} "
                                      f"free")
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            nxt = block.next_free
            block.prev_free = block.next_free = None
            blocks.append(block)
            block = nxt
        self._head.next_free, block.prev_free = block, self._head
        self.num_free_blocks -= n
        return blocks

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append ``blocks`` in order, chained to each other and to the tail once."""
        last = self._tail.prev_free
        for block in blocks:
            last.next_free, block.prev_free = block, last
            last = block
        last.next_free, self._tail.prev_free = self._tail, last
        self.num_free_blocks += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ParameterError("block", f"block {block.block_id} is not in the free queue")
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
    """All KV blocks of one GPU, with reference counts and the prefix-cache index
    (:ref:`ch03-paged-attention`)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # hash value -> the block cached under it
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
        blocks = self.free_queue.popleft_n(n)
        cached, evicted = self.cached, 0
        for block in blocks:
            if block.block_hash is not None:  # evict its cached prefix
                del cached[block.block_hash.value]
                block.block_hash = block.parent_content_id = None
                evicted += 1
            block.generation += 1  # new content: links recorded to the old one stop matching
            block.ref_cnt = 1
        self.num_evictions += evicted
        return blocks

    def get_cached_block(self, block_hash: BlockHash,
                         parent: KVCacheBlock | None) -> KVCacheBlock | None:
        """The cached block holding ``block_hash``'s tokens right after ``parent``'s prefix.

        ``parent`` is the block a lookup matched one position earlier (``None`` at the first
        block). The value finds a candidate in O(1); equal tokens and the same parent prove
        that the whole prefix matches, by induction from the first block. A hash collision is
        therefore a miss, never somebody else's KV.
        """
        block = self.cached.get(block_hash.value)
        if (block is None or block.block_hash != block_hash
                or block.parent_content_id != _content_id(parent)):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    parent: KVCacheBlock | None) -> None:
        """Record that ``block``, following ``parent`` in its sequence, now holds the full
        block ``block_hash`` names."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.value in self.cached:  # the same prefix twice, or a collision: keep one
            return
        block.block_hash = block_hash
        block.parent_content_id = (None if parent is None
                                   else (parent.block_id, parent.generation))
        self.cached[block_hash.value] = block

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          first: int, stop: int) -> None:
        """:meth:`cache_block` for ``blocks[first:stop]`` of one sequence, each after the one
        before it (vLLM's ``cache_full_blocks``): one call for a whole prompt."""
        if not self.enable_caching:
            return
        cached = self.cached
        parent = blocks[first - 1] if first else None
        for block, block_hash in zip(blocks[first:stop], block_hashes[first:stop], strict=True):
            # cache_block(block, block_hash, parent), inlined: a prompt has hundreds of blocks.
            if block.block_hash is None and block_hash.value not in cached:
                block.block_hash = block_hash
                block.parent_content_id = (None if parent is None
                                           else (parent.block_id, parent.generation))
                cached[block_hash.value] = block
            parent = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks nobody holds join the tail of the queue.

        Callers pass a request's blocks tail first, so its last blocks are evicted first and
        the shared beginning of a prompt stays cached longest.
        """
        freed = []
        try:
            for block in blocks:
                if block.ref_cnt <= 0:
                    raise ParameterError("blocks", f"blocks: block {block.block_id} freed more "
                                                   f"often than taken")
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    freed.append(block)
        finally:  # even on that error, the blocks already released join the queue
            self.free_queue.append_n(freed)


def _content_id(block: KVCacheBlock | None) -> tuple[int, int] | None:
    return block.content_id if block is not None else None
