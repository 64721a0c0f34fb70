"""Memory accounting: contiguous preallocation against paging (:ref:`ch03-paged-attention`).

Before PagedAttention, servers reserved ``max_model_len`` contiguous slots per request, since
nobody knows in advance how long the answer will be. Paging allocates ``block_size`` slots at a
time, so the only waste is the unfilled tail of each request's last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, positive_int
from labkit.units import cdiv


@dataclass(frozen=True)
class MemoryWaste:
    """KV slots held for a workload under both schemes, in tokens."""

    used_tokens: int
    paged_tokens: int
    contiguous_tokens: int

    @property
    def paged_waste(self) -> float:
        """Share of paged slots holding no token (internal fragmentation of last blocks)."""
        return 1 - self.used_tokens / self.paged_tokens

    @property
    def contiguous_waste(self) -> float:
        """Share of preallocated slots holding no token."""
        return 1 - self.used_tokens / self.contiguous_tokens


def memory_waste(seq_lens: Sequence[int], block_size: int, max_model_len: int) -> MemoryWaste:
    """Slots reserved for sequences of final lengths ``seq_lens`` (prompt + output)."""
    positive_int("block_size", block_size)
    if any(n < 1 or n > max_model_len for n in seq_lens):
        raise ParameterError("seq_lens", f"seq_lens: every sequence length must be in "
                                         f"[1, max_model_len={max_model_len}]")
    used = sum(seq_lens)
    paged = sum(cdiv(n, block_size) * block_size for n in seq_lens)
    return MemoryWaste(used, paged, max_model_len * len(seq_lens))
