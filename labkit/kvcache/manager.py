"""The KV cache manager: the scheduler's view of KV memory (:ref:`ch03-paged-attention`).

Its verbs are the engine's: how much of a prompt is already cached, allocate slots for the
tokens about to be computed (or say they do not fit), fork a sequence, free a request. Names
follow vLLM v1's ``KVCacheManager``. It owns no tensors: it hands out block ids, and the
attention kernel (:mod:`labkit.attention`) reads K and V through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from operator import attrgetter
from typing import TypeVar

from labkit.checks import ParameterError, positive_int
from labkit.kvcache.block_pool import BlockPool, KVCacheBlock
from labkit.kvcache.hashing import BlockHash, BlockHasher, HashFn
from labkit.units import cdiv

T = TypeVar("T")


class KVCacheManager:
    """Paged KV memory for many requests, with prefix caching of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash) -> None:
        positive_int("block_size", block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # What requests name their blocks with; None when nothing is cached, so nothing hashed.
        self.block_hasher = BlockHasher(block_size, hash_fn) if enable_prefix_caching else None
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as ids: cheap to copy
        self.req_num_slots: dict[str, int] = {}
        # Each request's chained block hashes (its own list when it keeps one), and how many of
        # its leading full blocks have been offered to the prefix cache.
        self.req_block_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}
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
        return list(_of_request(self.req_block_ids, request_id))

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash],
                            num_tokens: int) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding the longest cached prefix of a request, and its token count.

        ``block_hashes`` are the request's full-block hashes (``Request.block_hashes``, or
        :func:`~labkit.kvcache.hash_request_blocks` of its tokens) and ``num_tokens`` its
        length. Nothing is hashed here: a request that waits and asks again every step pays
        one dictionary lookup per block. The last token is never taken from the cache, even
        when the whole prompt is cached: the model must run on it to produce the logits of
        the first output token.
        """
        if not self.enable_prefix_caching or num_tokens < 1:
            return [], 0
        hits: list[KVCacheBlock] = []
        for block_hash in islice(block_hashes, (num_tokens - 1) // self.block_size):
            block = self.block_pool.get_cached_block(block_hash, hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = (),
                       block_hashes: list[BlockHash] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request_id``.

        ``token_ids`` are all the request's tokens known so far; ``computed_blocks`` (first
        call only) are its prefix-cache hits. ``block_hashes`` is the request's own list of
        block hashes when it keeps one (``Request.block_hashes``); the manager holds on to it
        from the first call and caches full blocks under those hashes. Without it the manager
        keeps a list for the request itself. Either way each block is hashed once.

        ``num_lookahead_tokens`` more slots follow, for speculative decoding's draft tokens
        (vLLM's name): they are not among ``token_ids``, and their blocks are never offered
        to the prefix cache; :meth:`trim_slots` hands back those of rejected drafts.

        Returns the newly taken blocks, or ``None`` with nothing changed when too few blocks
        are free: the scheduler then preempts or waits. Full blocks are registered in the
        prefix cache as soon as their slots exist.
        """
        positive_int("num_new_tokens", num_new_tokens)
        known = request_id in self.req_to_blocks
        if known and computed_blocks:
            raise ParameterError("computed_blocks", f"computed_blocks: request {request_id!r} "
                                                    f"already has blocks; cached prefix blocks "
                                                    f"are only taken on its first allocation")
        blocks = self.req_to_blocks.get(request_id, [])
        slots = self.req_num_slots[request_id] if known else len(computed_blocks) * self.block_size
        positive_int("num_lookahead_tokens", num_lookahead_tokens, at_least=0)
        known_slots = slots + num_new_tokens
        if known_slots > len(token_ids):
            raise ParameterError("num_new_tokens", f"num_new_tokens: request {request_id!r}: "
                                                   f"{known_slots} slots asked for but only "
                                                   f"{len(token_ids)} tokens are known")
        total = known_slots + num_lookahead_tokens
        blocks_needed = cdiv(total, self.block_size)
        if blocks_needed > self.num_blocks:
            raise ParameterError("num_new_tokens", f"num_new_tokens: request {request_id!r} "
                                                   f"needs {blocks_needed} blocks; the cache "
                                                   f"has {self.num_blocks} in all")
        num_new_blocks = blocks_needed - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if num_new_blocks > self.block_pool.num_free_blocks - revived:
            return None

        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        if not known:
            self.req_to_blocks[request_id] = blocks = list(computed_blocks)
            self.req_block_ids[request_id] = [b.block_id for b in computed_blocks]
            self.req_block_hashes[request_id] = (
                block_hashes if block_hashes is not None
                else [b.block_hash for b in computed_blocks])
            self.req_num_cached_blocks[request_id] = len(computed_blocks)
        blocks.extend(new_blocks)
        self.req_block_ids[request_id].extend(map(_block_id, new_blocks))
        self.req_num_slots[request_id] = total
        self._cache_full_blocks(request_id, token_ids, known_slots)
        return new_blocks

    def trim_slots(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int:
        """Keep slots for the first ``num_tokens`` tokens of ``request_id`` only, and hand
        the blocks past them back to the pool; returns how many went back.

        After speculative decoding verifies a step's drafts, ``num_tokens`` is the request's
        computed tokens, accepted drafts included: the slots of rejected drafts are freed at
        once rather than held until the request ends. ``token_ids`` are the request's tokens
        now; blocks the accepted drafts filled are offered to the prefix cache. A slot that
        holds a cached block is never given up.
        """
        slots = _of_request(self.req_num_slots, request_id)
        kept_blocks = self.req_num_cached_blocks[request_id] * self.block_size
        if not kept_blocks <= num_tokens <= min(slots, len(token_ids)):
            raise ParameterError("num_tokens", f"num_tokens: request {request_id!r} can keep "
                                               f"{kept_blocks} to {min(slots, len(token_ids))} "
                                               f"slots, got {num_tokens}")
        blocks = self.req_to_blocks[request_id]
        keep = cdiv(num_tokens, self.block_size)
        released = blocks[keep:]
        del blocks[keep:], self.req_block_ids[request_id][keep:]
        self.block_pool.free_blocks(reversed(released))
        self.req_num_slots[request_id] = num_tokens
        self._cache_full_blocks(request_id, token_ids, num_tokens)
        return len(released)

    def fork(self, parent_id: str, child_id: str,
             block_hashes: list[BlockHash] | None = None) -> list[tuple[int, int]] | None:
        """Start ``child_id`` as a copy of ``parent_id`` (parallel sampling, beam search).

        Full blocks are shared (reference counted); a partly filled last block is copied to a
        fresh block, since both sequences will write to it. ``block_hashes`` is the child's
        own list, as in :meth:`allocate_slots`. Returns the ``(src, dst)`` block copies the
        engine must perform, or ``None`` with nothing changed when no block is free for the copy.
        """
        if child_id in self.req_to_blocks:
            raise ParameterError("child_id", f"child_id: request {child_id!r} already exists")
        blocks = _of_request(self.req_to_blocks, parent_id, "parent_id")
        slots = self.req_num_slots[parent_id]
        shared = blocks[: slots // self.block_size]
        partial = blocks[len(shared):]
        if len(partial) > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(shared)
        copies = self.block_pool.get_new_blocks(len(partial))
        self.req_to_blocks[child_id] = shared + copies
        self.req_block_ids[child_id] = [b.block_id for b in shared + copies]
        self.req_num_slots[child_id] = slots
        self.req_block_hashes[child_id] = (
            block_hashes if block_hashes is not None
            else self.req_block_hashes[parent_id][:len(shared)])
        self.req_num_cached_blocks[child_id] = len(shared)  # the parent offered them already
        return [(src.block_id, dst.block_id) for src, dst in zip(partial, copies, strict=True)]

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks (cached ones stay cached)."""
        blocks = _of_request(self.req_to_blocks, request_id)
        self.block_pool.free_blocks(reversed(blocks))
        del self.req_to_blocks[request_id], self.req_block_ids[request_id]
        del self.req_num_slots[request_id]
        del self.req_block_hashes[request_id], self.req_num_cached_blocks[request_id]

    def _cache_full_blocks(self, request_id: str, token_ids: Sequence[int],
                           num_slots: int) -> None:
        """Offer the request's newly full blocks to the prefix cache, each after its parent."""
        num_full, first = num_slots // self.block_size, self.req_num_cached_blocks[request_id]
        if self.block_hasher is None or num_full == first:  # most decode steps fill no block
            return
        block_hashes = self.req_block_hashes[request_id]
        self.block_hasher.extend(block_hashes, token_ids)  # no-op if the request hashed them
        self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, first,
                                          num_full)
        self.req_num_cached_blocks[request_id] = num_full


_block_id = attrgetter("block_id")  # in C: a prompt takes hundreds of blocks at once


def _of_request(table: dict[str, T], request_id: str, param: str = "request_id") -> T:
    try:
        return table[request_id]
    except KeyError:
        raise ParameterError(param, f"{param}: unknown request {request_id!r}") from None
