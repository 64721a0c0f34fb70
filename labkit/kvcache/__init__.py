"""Paged KV memory (:ref:`ch03-paged-attention`).

- :class:`BlockPool`: blocks, reference counts, the O(1) free queue that is also the LRU
  eviction order, and the prefix-cache index.
- :class:`KVCacheManager`: the engine's verbs (cached prefix, allocate slots, fork, free).
- :class:`BlockHasher`: chained block hashes, computed once per block of a request.
- :class:`RadixCache`: SGLang's alternative, a radix tree over token ids.
- :func:`memory_waste`: contiguous preallocation against paging, on a workload.
- :func:`prefix_hit_rates`: one trace through both prefix caches.
"""

from labkit.kvcache.accounting import MemoryWaste, memory_waste
from labkit.kvcache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from labkit.kvcache.hashing import BlockHash, BlockHasher, hash_request_blocks
from labkit.kvcache.manager import KVCacheManager
from labkit.kvcache.radix import RadixCache
from labkit.kvcache.replay import HitRates, prefix_hit_rates

__all__ = ["BlockHash", "BlockHasher", "BlockPool", "FreeBlockQueue", "HitRates", "KVCacheBlock",
           "KVCacheManager", "MemoryWaste", "RadixCache", "hash_request_blocks", "memory_waste",
           "prefix_hit_rates"]
