"""Chained block hashes for prefix caching (:ref:`ch03-paged-attention`).

A full block is named by the hash of its parent block's hash value and its own token ids, so
one integer stands for the whole prefix up to the end of the block. A request hashes each of
its blocks once, when the block fills, and keeps the list (``Request.block_hashes``, as vLLM
does): prefix lookups and caching read that list and never hash the prompt again.

A hash value alone proves nothing: two different prefixes can collide, and sharing KV on a
collision would be a silent wrong answer. So a ``BlockHash`` also keeps its block's own
tokens, and the block pool records which physical block held the prefix before each cached
block (:class:`~labkit.kvcache.BlockPool`). A lookup walks a prompt from its first block:
equal value, equal tokens and the parent it has just matched prove the whole prefix by
induction, at O(block_size) per block. Keeping the parent hash inside each hash instead would
make every comparison walk the whole prefix: quadratic time, and a ``RecursionError`` on a
prompt of a few hundred blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from labkit.checks import positive_int

HashFn = Callable[[tuple], int]


class BlockHash(NamedTuple):
    """A full block's chained hash value and its own token ids; equality compares both.

    A named tuple rather than a frozen dataclass: a long simulation makes millions of them,
    and a tuple is built several times faster.
    """

    value: int
    token_ids: tuple[int, ...]


# ``BlockHash(value, tokens)`` runs a Python-level ``__new__``; this builds the same tuple in C,
# in about half the time (timeit), for the hundreds of thousands of blocks a simulation hashes.
_new_block_hash = tuple.__new__


@dataclass(frozen=True)
class BlockHasher:
    """Hashes the full blocks of a growing sequence, each block once (vLLM's block hasher).

    The KV cache manager owns one (its ``block_size`` and ``hash_fn``); the scheduler gives it
    to every request, which then extends its ``block_hashes`` whenever a token fills a block.
    """

    block_size: int
    hash_fn: HashFn = hash

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)

    def extend(self, block_hashes: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Append to ``block_hashes`` the hashes of the full blocks of ``token_ids`` that it
        does not have yet; a partial last block gets none until it fills."""
        first = len(block_hashes) * self.block_size  # the first token not in a hashed block
        if len(token_ids) - first >= self.block_size:  # most calls: a token that fills none
            self.extend_with(block_hashes, token_ids[first:] if first else token_ids)

    def extend_with(self, block_hashes: list[BlockHash], new_token_ids: Sequence[int]) -> None:
        """:meth:`extend`, given only the tokens after the blocks ``block_hashes`` has: a
        simulator that knows a request's whole output hashes it without copying the prompt."""
        size, hash_fn = self.block_size, self.hash_fn
        parent = block_hashes[-1].value if block_hashes else None
        # zip over ``size`` references to one iterator: the full blocks' token tuples, cut in C
        # (not strict: it stops before a partial last block, which gets no hash).
        for tokens in zip(*[iter(new_token_ids)] * size, strict=False):
            parent = hash_fn((parent, tokens))
            block_hashes.append(_new_block_hash(BlockHash, (parent, tokens)))


def hash_request_blocks(token_ids: Sequence[int], block_size: int,
                        hash_fn: HashFn = hash) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``; a partial tail gets none."""
    block_hashes: list[BlockHash] = []
    BlockHasher(block_size, hash_fn).extend(block_hashes, token_ids)
    return block_hashes
