"""Prompt text of an exact token length, made the way ``vllm bench serve`` makes its random
dataset (:ref:`ch02-benchmarking`).

A workload says how many tokens each prompt holds; the server counts them with its own
tokenizer. Text made of words has as many tokens as that tokenizer makes of them: on the
course's tiny Llama a word of English is about 2.5 tokens, so a "64-token" prompt of 64 words
is a 160-token prompt to the server, and every latency measured on it belongs to another
workload. vLLM's random dataset draws token ids instead, decodes them to text, and since
``encode(decode(ids))`` need not give ``ids`` back (a BPE tokenizer merges across the seams),
re-encodes the text and truncates or pads the ids until the round trip holds, at most 10
times (``gen_prompt_decode_to_target_len`` in ``vllm/benchmarks/datasets``). It also leaves
room for the special tokens the server adds (Llama's BOS), so the server's count
(``usage.prompt_tokens``) is the length asked for. :func:`exact_length_text` does the same;
:meth:`labkit.simulate.Workload.bench_requests` uses it when given the server's tokenizer.

A tokenizer here is anything with ``encode(text, add_special_tokens)``, ``decode(ids)``,
``vocab_size`` and ``all_special_ids``: :class:`labkit.engine.tokenizer.Tokenizer` (the
teaching engine's) and ``transformers``' tokenizers both are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from labkit.checks import positive_int

#: The words of the text view without a tokenizer: prompts of one word per token, whose
#: exact token count the server's tokenizer decides.
WORDS = ("the cache holds keys and values for every token of every sequence while the "
         "scheduler batches requests and the kernels read weights from memory").split()

#: Round trips before giving up on an exact length, as vLLM's ``max_retry``.
MAX_ROUND_TRIPS = 10


class TokenizerLike(Protocol):
    """What :func:`exact_length_text` needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def special_tokens_added(tokenizer: TokenizerLike) -> int:
    """How many tokens the tokenizer adds to every text it encodes for a server (Llama: the
    BOS token, 1); a prompt of ``n`` tokens holds ``n`` minus this many of its own."""
    return len(tokenizer.encode("", add_special_tokens=True)) - len(
        tokenizer.encode("", add_special_tokens=False))


def ordinary_token_ids(tokenizer: TokenizerLike) -> np.ndarray:
    """The token ids a prompt is drawn from: every id that is not special (those decode to
    markup such as ``<|begin_of_text|>``; vLLM's random dataset leaves them out too) and that
    comes back as itself from a round trip. vLLM keeps the others; a byte-level BPE has
    tokens for single bytes of a multi-byte character, which decode to U+FFFD, and each such
    one re-encodes to three tokens, so the lengths drift (its own run on the tiny Llama sent
    2,566 prompt tokens for 2,560)."""
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(tokenizer.vocab_size) if t not in special
                     and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False)
                     == [t]])


def exact_length_text(tokenizer: TokenizerLike, token_ids: Sequence[int], length: int,
                      rng: np.random.Generator,
                      pool: np.ndarray | None = None) -> tuple[str, list[int]]:
    """Text that encodes (without special tokens) to ``length`` tokens, starting from
    ``token_ids``: decode, re-encode, truncate or pad with ids drawn by ``rng`` from ``pool``
    (default :func:`ordinary_token_ids`), until the round trip holds or
    :data:`MAX_ROUND_TRIPS` are spent. Returns the text and the ids it encodes to; their
    length is ``length`` unless the tokenizer never settled (the caller sees the difference).
    """
    positive_int("length", length, at_least=0)
    pool = ordinary_token_ids(tokenizer) if pool is None else pool
    ids = list(token_ids)
    for _ in range(MAX_ROUND_TRIPS + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > length:
            ids = ids[:length]
        elif len(ids) < length:
            ids = ids + rng.choice(pool, size=length - len(ids)).tolist()
        else:
            return text, ids
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)
