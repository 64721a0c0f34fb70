"""Replay one trace through both prefix caches and compare hit rates
(:ref:`ch03-paged-attention`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError
from labkit.kvcache.hashing import hash_request_blocks
from labkit.kvcache.manager import KVCacheManager
from labkit.kvcache.radix import RadixCache


@dataclass(frozen=True)
class HitRates:
    """Share of prompt tokens served from cache, per scheme."""

    paged: float
    radix: float
    prompt_tokens: int


def prefix_hit_rates(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                     capacity_tokens: int, block_size: int = 16) -> HitRates:
    """Serve ``sequences`` one after another with the same KV capacity in both caches.

    Each sequence is a prompt (its first ``prompt_lens[i]`` tokens) plus its output; both
    are cached after it finishes, as engines do, so the next turn of a conversation can hit.
    Hashed blocks hit whole blocks only; the radix tree hits to the token.
    """
    if len(sequences) != len(prompt_lens):
        raise ParameterError("prompt_lens", "prompt_lens must have one length per sequence")
    paged = KVCacheManager(capacity_tokens // block_size, block_size)
    radix = RadixCache(capacity_tokens)
    paged_hits = radix_hits = prompt_tokens = 0
    for i, (seq, prompt_len) in enumerate(zip(sequences, prompt_lens, strict=True)):
        if not 1 <= prompt_len <= len(seq):
            raise ParameterError("prompt_lens", f"prompt_lens[{i}] must be in [1, {len(seq)}]")
        prompt = seq[:prompt_len]
        prompt_tokens += prompt_len

        block_hashes = hash_request_blocks(seq, block_size)  # the prompt's blocks come first
        blocks, hit = paged.get_computed_blocks(block_hashes, prompt_len)
        if paged.allocate_slots(str(i), seq, len(seq) - hit, blocks, block_hashes) is None:
            raise ParameterError("capacity_tokens", f"capacity_tokens: sequence {i} "
                                                    f"({len(seq)} tokens) exceeds the cache")
        paged.free(str(i))
        paged_hits += hit

        slots, node = radix.match_prefix(prompt)
        hit = min(len(slots), prompt_len - 1)  # the last prompt token is always computed
        radix.inc_lock_ref(node)
        new = radix.alloc(len(seq) - hit)
        if new is None:
            raise ParameterError("capacity_tokens", f"capacity_tokens: sequence {i} "
                                                    f"({len(seq)} tokens) exceeds the cache")
        cached = radix.insert(seq, slots[:hit] + new)
        radix.free(new[: cached - hit])  # positions the tree already held
        radix.dec_lock_ref(node)
        radix_hits += hit
    return HitRates(paged_hits / prompt_tokens, radix_hits / prompt_tokens, prompt_tokens)
