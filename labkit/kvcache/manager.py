"""The KV cache manager: the scheduler's view of KV memory (chapter 3.1).

Its verbs are the engine's: how much of a prompt is already cached, allocate slots for the
tokens about to be computed (or say they do not fit), fork a sequence, free a request. Names
follow vLLM v1's ``KVCacheManager``. It owns no tensors: it hands out block ids, and the
attention kernel (:mod:`labkit.attention`) reads K and V through them.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.kvcache.block_pool import BlockPool, KVCacheBlock
from labkit.kvcache.hashing import BlockHash, HashFn, hash_block_tokens, hash_request_blocks


class KVCacheManager:
    """Paged KV memory for many requests, with prefix caching of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_num_slots: dict[str, int] = {}
        self.req_block_hashes: dict[str, list[BlockHash]] = {}
        # vLLM's prefix-cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: logical block i lives in physical block ids[i]."""
        return [b.block_id for b in self._blocks_of(request_id)]

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks matching the longest prefix of ``token_ids``, and their token count.

        The last token is never taken from the cache, even when the whole prompt is cached:
        the model must run on it to produce the logits of the first output token.
        """
        if not self.enable_prefix_caching or not token_ids:
            return [], 0
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hash_request_blocks(token_ids[:usable], self.block_size, self.hash_fn):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request_id``.

        ``token_ids`` are all the request's tokens known so far; ``computed_blocks`` (first
        call only) are its prefix-cache hits. Returns the newly taken blocks, or ``None`` with
        nothing changed when too few blocks are free: the scheduler then preempts or waits.
        Full blocks are registered in the prefix cache as soon as their slots exist.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive integer, got {num_new_tokens!r}")
        known = request_id in self.req_to_blocks
        if known and computed_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; cached prefix blocks "
                             f"are only taken on its first allocation")
        blocks = self.req_to_blocks.get(request_id, [])
        slots = self.req_num_slots[request_id] if known else len(computed_blocks) * self.block_size
        total = slots + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"request {request_id!r}: {total} slots asked for but only "
                             f"{len(token_ids)} tokens are known")
        blocks_needed = -(-total // self.block_size)
        if blocks_needed > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs {blocks_needed} blocks; the cache "
                             f"has {self.num_blocks} in all")
        num_new_blocks = blocks_needed - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if num_new_blocks > self.block_pool.num_free_blocks - revived:
            return None

        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if not known:
            self.req_to_blocks[request_id] = blocks = list(computed_blocks)
            self.req_block_hashes[request_id] = [b.block_hash for b in computed_blocks]
        blocks.extend(new_blocks)
        self.req_num_slots[request_id] = total
        self._cache_full_blocks(request_id, token_ids, total)
        return new_blocks

    def fork(self, parent_id: str, child_id: str) -> list[tuple[int, int]] | None:
        """Start ``child_id`` as a copy of ``parent_id`` (parallel sampling, beam search).

        Full blocks are shared (reference counted); a partly filled last block is copied to a
        fresh block, since both sequences will write to it. Returns the ``(src, dst)`` block
        copies the engine must perform, or ``None`` when no block is free for the copy.
        """
        if child_id in self.req_to_blocks:
            raise ValueError(f"request {child_id!r} already exists")
        blocks = self._blocks_of(parent_id)
        slots = self.req_num_slots[parent_id]
        shared = blocks[: slots // self.block_size]
        partial = blocks[len(shared):]
        if len(partial) > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(shared)
        copies = self.block_pool.get_new_blocks(len(partial))
        self.req_to_blocks[child_id] = shared + copies
        self.req_num_slots[child_id] = slots
        self.req_block_hashes[child_id] = list(self.req_block_hashes[parent_id])
        return [(src.block_id, dst.block_id) for src, dst in zip(partial, copies, strict=True)]

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks (cached ones stay cached)."""
        blocks = self._blocks_of(request_id)
        self.block_pool.free_blocks(reversed(blocks))
        del self.req_to_blocks[request_id], self.req_num_slots[request_id]
        del self.req_block_hashes[request_id]

    def _blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        try:
            return self.req_to_blocks[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r}") from None

    def _cache_full_blocks(self, request_id: str, token_ids: Sequence[int], total: int) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self.req_block_hashes[request_id]
        blocks = self.req_to_blocks[request_id]
        for i in range(len(hashes), total // self.block_size):
            parent = hashes[-1] if hashes else None
            tokens = token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block_tokens(parent, tokens, self.hash_fn))
            self.block_pool.cache_block(blocks[i], hashes[-1])
