"""Drafts from a smaller model, for speculative decoding (:ref:`ch09-inside`): vLLM's
``"method": "draft_model"``.

A draft model shares the target's tokenizer (vLLM checks that the vocabularies are the same
size) and is cheaper to run: fewer layers, narrower ones. Each step it reads the sequence and
guesses the next ``num_speculative_tokens`` tokens greedily, one forward pass per token. vLLM
drafts greedily too unless told otherwise (``draft_sample_method="greedy"``, its default): the
draft's probabilities are then treated as certain, and the drafts are verified by the same rule
as n-gram drafts (:func:`~labkit.engine.speculative.verify`), so greedy output is unchanged and
sampled output keeps the target's distribution.

The cost differs from vLLM's, not the drafts: here the draft keeps no KV cache between steps
and reads the whole sequence again at every proposal, one request at a time, in a scratch
paged cache of its own; vLLM gives the draft model a paged KV cache kept across steps and
drafts for the whole batch at once.

A course without a published draft model can make one from its target with chapter 4's
quantizer (:func:`labkit.quant.model.quantize_checkpoint`): same tokenizer, fewer bits, and
an agreement with the target that falls with the bits, which is what acceptance measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from labkit.checks import ParameterError
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.speculative import NgramProposer, Proposer, SpeculativeConfig

#: Tokens per block of the draft's scratch KV cache.
DRAFT_BLOCK_SIZE = 16


class DraftModelProposer:
    """vLLM's ``method="draft_model"`` proposer: ``config.model``'s greedy guesses."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, max_model_len: int) -> None:
        if config.model is None:
            raise ParameterError("speculative_config", "speculative_config: method "
                                 "'draft_model' needs model, the draft model's directory")
        if not (Path(config.model) / "config.json").is_file():
            raise ParameterError("speculative_config", f"speculative_config: model "
                                 f"{config.model!r} is not a model directory (no config.json)")
        self.num_blocks = -(-max_model_len // DRAFT_BLOCK_SIZE)
        self.model = LlamaModel.load(config.model, self.num_blocks, DRAFT_BLOCK_SIZE)
        if self.model.spec.vocab_size != vocab_size:
            raise ParameterError("speculative_config", f"speculative_config: the draft model's "
                                 f"vocabulary has {self.model.spec.vocab_size} tokens, the "
                                 f"target's {vocab_size}: a draft must share the target's "
                                 f"tokenizer")
        self.config = config

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k <= 0:
            return []
        table = list(range(self.num_blocks))  # one sequence: the whole scratch cache, in order
        new, start, drafts = list(token_ids), 0, []
        while len(drafts) < k:
            logits = self.model.forward([SequenceBatch(new, start, table, all_logits=False)])
            drafts.append(int(np.argmax(logits[0][-1])))
            start += len(new)
            new = drafts[-1:]
        return drafts


def make_proposer(config: SpeculativeConfig, vocab_size: int, max_model_len: int) -> Proposer:
    """The proposer ``config.method`` names."""
    if config.method == "draft_model":
        return DraftModelProposer(config, vocab_size, max_model_len)
    return NgramProposer(config)
