"""The gateway's approximate prefix index: which backend likely holds a prompt's prefix
(chapter 5: the prefix scorer of :ref:`ch05-choosing-backend`).

A backend with prefix caching (vLLM's ``--enable-prefix-caching``, the teaching engine's paged KV
cache of chapter 3) skips the prefill of every leading block it already holds. The gateway
cannot see those caches, so it keeps its own guess, the way the prefix-cache scorer of the
Gateway API Inference Extension / llm-d inference scheduler does: it remembers which prompts it
sent where. No tokenizer runs in the request path; the prompt is cut into fixed-size chunks of
characters, and each chunk is named by a chained hash (its text and its parent chunk's hash),
so one integer stands for the whole prefix up to the end of that chunk, as in chapter 3's block
hashes (:mod:`labkit.kvcache.hashing`).

Defaults and behaviour follow llm-d's approximate prefix producer,
``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/`` in
github.com/llm-d/llm-d-inference-scheduler (commit 520af478, 2026-05-17; before the move it
was ``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`` in
kubernetes-sigs/gateway-api-inference-extension v1.3.1, 2026-02-19):

- chunk size: 16 tokens (vLLM's default ``block_size``) x 4 characters per token = **64
  characters** (``defaultBlockSizeTokens = 16``, ``averageCharactersPerToken = 4`` in
  ``types.go``; ``DefaultBlockSize = 64`` characters in the v1.3.1 plugin);
- at most **256** chunks are hashed (``defaultMaxPrefixBlocks``), so two prompts that agree on
  their first 16,384 characters look the same;
- an LRU of **31,250** hashes per backend (``defaultLRUCapacityPerServer``: a Llama-3-8B on an
  80 GB H100 caches about 500K tokens, 31.25K blocks of 16);
- the first hash is seeded with the model name, a trailing partial chunk is hashed too, and a
  prompt shorter than one chunk gets no chunks at all (``hashing.go``);
- a backend's match is its number of leading chunks found in the index, and the prefix scorer's
  score is ``matched / total`` (``scorer/prefix/plugin.go``).

Two deliberate differences. Upstream hashes the request body's bytes with xxHash64; we hash the
prompt's characters with BLAKE2b cut to 8 bytes (in the standard library, and stable across
processes, unlike Python's salted ``hash()``). And upstream inserts a prompt's hashes into the
LRU first chunk first, so the *first* chunk is evicted first and the whole chain stops
matching; we insert them last chunk first, so the tail goes first and the shared prefix
survives longest, which is what vLLM's own KV cache does (``SingleTypeKVCacheManager.free`` in
``vllm/v1/core/single_type_kv_cache_manager.py`` frees "in reverse order so that the tail blocks
are freed first"; :meth:`labkit.kvcache.KVCacheManager.free` copies it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from labkit.checks import positive_int

DEFAULT_BLOCK_SIZE_CHARS = 16 * 4      # llm-d: 16 tokens x 4 characters per token
DEFAULT_MAX_CHUNKS = 256               # llm-d: defaultMaxPrefixBlocks
DEFAULT_CAPACITY_PER_ENDPOINT = 31_250  # llm-d: defaultLRUCapacityPerServer


def _hash(parent: int, text: str) -> int:
    """An 8-byte BLAKE2b of the parent hash and this chunk's text, as an int."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + text.encode("utf-8"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


class PrefixIndex:
    """Chained hashes of the prompts sent to each backend, an LRU of hashes per backend.

    ``record(prompt, url)`` after a request went to ``url``; ``match(prompt)`` before routing
    the next one; ``remove(url)`` when a backend leaves or loses its cache. Not thread-safe:
    the proxy calls it from its one event loop (chapter 5).
    """

    def __init__(self, *, block_size_chars: int = DEFAULT_BLOCK_SIZE_CHARS,
                 max_chunks: int = DEFAULT_MAX_CHUNKS,
                 capacity_per_endpoint: int = DEFAULT_CAPACITY_PER_ENDPOINT) -> None:
        self.block_size_chars = positive_int("block_size_chars", block_size_chars)
        self.max_chunks = positive_int("max_chunks", max_chunks)
        self.capacity_per_endpoint = positive_int("capacity_per_endpoint", capacity_per_endpoint)
        self._lru: dict[str, OrderedDict[int, None]] = {}  # url -> hashes, oldest first
        self._owners: dict[int, set[str]] = {}               # hash -> urls that hold it

    def num_chunks(self, prompt: str) -> int:
        """How many chunks ``prompt`` is cut into: ``len(chunk_hashes(prompt))``, unhashed."""
        if len(prompt) < self.block_size_chars:
            return 0
        length = min(len(prompt), self.block_size_chars * self.max_chunks)
        return -(-length // self.block_size_chars)  # the last chunk may be short

    def chunk_hashes(self, prompt: str, *, model: str | None = None) -> list[int]:
        """The chained hash of each chunk of ``prompt`` (empty if shorter than one chunk)."""
        size = self.block_size_chars
        if len(prompt) < size:
            return []
        text = prompt[:size * self.max_chunks]
        # Different models never share KV, so the chain starts from the model's name.
        parent = _hash(0, model or "")
        hashes = []
        for start in range(0, len(text), size):
            parent = _hash(parent, text[start:start + size])
            hashes.append(parent)
        return hashes

    def match(self, prompt: str, *, model: str | None = None) -> dict[str, int]:
        """``{url: number of leading chunks of prompt that url holds}``, for urls with >= 1."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(self.chunk_hashes(prompt, model=model), start=1):
            owners = self._owners.get(h, set())
            # A backend counts only while its run of chunks is unbroken: leading chunks.
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for url in alive:
                matched[url] = depth
        return matched

    def record(self, prompt: str, url: str, *, model: str | None = None) -> None:
        """Remember that ``url`` now holds ``prompt``'s chunks; evict its oldest beyond capacity."""
        lru = self._lru.setdefault(url, OrderedDict())
        # Last chunk first, so the first chunk is the most recent: tails are evicted first.
        for h in reversed(self.chunk_hashes(prompt, model=model)):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._owners.setdefault(h, set()).add(url)
        while len(lru) > self.capacity_per_endpoint:
            old, _ = lru.popitem(last=False)
            self._forget(old, url)

    def remove(self, url: str) -> None:
        """Forget everything recorded for ``url`` (it left, or restarted with an empty cache)."""
        for h in self._lru.pop(url, {}):
            self._forget(h, url)

    def size(self, url: str) -> int:
        """How many chunk hashes are remembered for ``url``."""
        return len(self._lru.get(url, ()))

    def _forget(self, h: int, url: str) -> None:
        owners = self._owners[h]
        owners.discard(url)
        if not owners:
            del self._owners[h]
