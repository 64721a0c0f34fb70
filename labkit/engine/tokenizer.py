"""The model's tokenizer and chat template, from ``tokenizer.json`` (chapter 2.1)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    """Encode, decode and render chat prompts the way ``transformers`` does for this model."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = config.get("chat_template")
        self._template = (ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
                          .from_string(template) if template else None)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` (``role``/``content``) into the model's prompt text."""
        if self._template is None:
            raise ValueError("this model has no chat template; use a completion prompt")
        return self._template.render(messages=messages, bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "",
                                     add_generation_prompt=add_generation_prompt)


def _token_text(token) -> str | None:
    """``tokenizer_config.json`` stores special tokens as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token
