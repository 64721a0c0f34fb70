"""Sampling parameters and the sampler, with vLLM's names and checks (chapter 2.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. Field names follow vLLM's.

    ``temperature=0`` is greedy. ``top_k=-1`` (or 0) and ``top_p=1`` disable those filters.
    ``seed`` makes one request's sampling reproducible whatever it is batched with.
    ``regex`` constrains the output to match a pattern (SGLang's parameter of that name).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    ignore_eos: bool = False
    regex: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, "
                             f"got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           allowed: np.ndarray | None = None) -> int:
    """One token id from a row of logits: mask, temperature, then top-k, then top-p."""
    if allowed is not None:
        if not allowed.any():
            raise ValueError("regex: no token can continue the output")
        logits = np.where(allowed, logits, -np.inf)
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k > 0:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(probs, dtype=bool)
        mask[keep] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))
