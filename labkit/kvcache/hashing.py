"""Chained block hashes for prefix caching (chapter 3.1).

A full block is named by the hash of its parent block's hash and its own token ids, so a block
hash stands for the whole prefix up to its end, not just its own tokens. Each ``BlockHash``
keeps its tokens and its parent: two prefixes whose hash values collide still compare unequal,
so they never share KV (a silent correctness bug no speed-up is worth).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[tuple], int]


@dataclass(frozen=True)
class BlockHash:
    """A block's chained hash value, with the prefix that produced it.

    Equality compares the value, the tokens and, recursively, the parent: the whole prefix.
    """

    value: int
    token_ids: tuple[int, ...]
    parent: BlockHash | None = None


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      hash_fn: HashFn = hash) -> BlockHash:
    """The hash of one full block, chained to its parent's."""
    parent_value = parent.value if parent is not None else None
    tokens = tuple(token_ids)
    return BlockHash(hash_fn((parent_value, tokens)), tokens, parent)


def hash_request_blocks(token_ids: Sequence[int], block_size: int,
                        hash_fn: HashFn = hash) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``; a partial tail gets none."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], hash_fn)
        hashes.append(parent)
    return hashes
