"""A request's input, checked as vLLM checks it (:ref:`ch02-offline-api`): the model's context
window, the prompt as text or token ids, and the ``max_tokens`` the window leaves.

Every refusal is a :class:`~labkit.checks.ParameterError` naming the request field at fault,
which the server turns into a 400 whose ``param`` names it. The engine calls these from
:meth:`~labkit.engine.LLMEngine.process_inputs`.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.checks import ParameterError
from labkit.engine.tokenizer import Tokenizer
from labkit.hardware import ModelSpec


def resolve_max_model_len(requested: int | None, spec: ModelSpec) -> int:
    """vLLM's rule: the model's ``max_position_embeddings`` unless asked for less."""
    limit = spec.max_position_embeddings or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ParameterError("max_model_len", f"max_model_len must be at most the model's "
                                              f"max_position_embeddings ({limit}), "
                                              f"got {requested}")
    return requested


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """A text prompt's token ids; a prompt that is not valid Unicode or encodes to nothing is
    refused (``prompt``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate from JSON's "\ud800"
        raise ParameterError("prompt", f"prompt is not valid Unicode: {err.reason} at "
                                       f"character {err.start}") from None
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise ParameterError("prompt", "prompt must not be empty")
    return token_ids


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """A prompt given as token ids, as a list; each must be an ``int`` of the vocabulary."""
    token_ids = list(token_ids)
    if not token_ids:
        raise ParameterError("prompt", "prompt must not be empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
           for t in token_ids):
        raise ParameterError("prompt", f"prompt token ids must be integers in "
                                       f"[0, {vocab_size})")
    return token_ids


def max_tokens_for(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """vLLM's rule (0.32): a prompt must fit the context window; the completion gets what
    the window leaves, or less if asked; asking for more than the window is an error."""
    room = max_model_len - prompt_len
    if room < 0:
        raise ParameterError(
            "input_tokens", f"This model's maximum context length is {max_model_len} "
                            f"tokens. However, your prompt contains {prompt_len} input "
                            f"tokens, which exceeds this limit even without any output "
                            f"tokens. Please reduce the length of the input prompt.")
    if requested is not None and requested > max_model_len:
        raise ParameterError("max_tokens", f"max_tokens={requested} cannot be greater than "
                                           f"max_model_len={max_model_len}")
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise ParameterError("max_tokens", f"max_tokens must be at least 1, got {max_tokens}: "
                                           f"the {prompt_len}-token prompt fills the context")
    return max_tokens
