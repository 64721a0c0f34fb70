"""The model's tokenizer and chat template, read as ``transformers`` 5 reads them
(:doc:`chapter 2 </chapters/ch02_engines>`).

Two details decide whether a prompt reaches the model as it was trained:

- **BOS.** Llama 3 expects every text to start with ``<|begin_of_text|>``, as its training
  texts did. No code says so: the ``post_processor`` of ``tokenizer.json`` adds it when a
  text is encoded with ``add_special_tokens=True``, the default of ``transformers`` and of
  vLLM's ``/v1/completions``. A chat template writes the BOS text itself, so a rendered chat
  prompt is encoded with ``add_special_tokens=False``, or it would start with two.
- **Where the chat template is.** Older checkpoints keep it in ``tokenizer_config.json``;
  ``save_pretrained`` of current ``transformers`` writes ``chat_template.jinja`` instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from labkit.checks import ParameterError

# The named special tokens transformers passes to every chat template (its
# ``SPECIAL_TOKENS_ATTRIBUTES``), from ``tokenizer_config.json``.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class Tokenizer:
    """Encode, decode and render chat prompts the way ``transformers`` does for this model.

    ``hf_tokenizer`` is the ``tokenizers.Tokenizer`` of ``tokenizer.json`` itself, for code that
    needs more than whole-text encode and decode (streaming detokenization).
    """

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        self.hf_tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special_tokens = {name: text for name in SPECIAL_TOKENS
                               if (text := _token_text(config.get(name))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_id = (self.hf_tokenizer.token_to_id(self.eos_token) if self.eos_token
                             else None)
        self.chat_templates = chat_templates(model_dir, config)

    @property
    def vocab_size(self) -> int:
        return self.hf_tokenizer.get_vocab_size()

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the special tokens (``transformers``' name): markup, not text."""
        return sorted(i for i, token in self.hf_tokenizer.get_added_tokens_decoder().items()
                      if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (Llama's BOS)."""
        return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` (``role``/``content``) into the model's prompt text.

        The template sees what ``transformers`` gives it: ``messages``,
        ``add_generation_prompt``, ``tools`` and ``documents`` (``None`` here), the special
        tokens, and the helpers ``raise_exception`` (Llama 2's template rejects roles out of
        turn with it) and ``strftime_now`` (Llama 3.1's writes today's date). A template that
        rejects the conversation raises a :class:`~labkit.checks.ParameterError` for
        ``messages``.
        """
        template = _compile(self.default_chat_template)
        try:
            return template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens)
        except jinja2.TemplateError as err:
            raise ParameterError("messages", f"messages: the chat template rejected them: "
                                             f"{err}") from None

    @property
    def default_chat_template(self) -> str:
        """The template chat requests use: the one named ``default``."""
        if not self.chat_templates:
            raise ParameterError("messages", (
                "messages: this model has no chat template (no chat_template.jinja, no "
                "chat_template in tokenizer_config.json; transformers' tokenizer does not read "
                "a processor's chat_template.json); use a completion prompt"))
        if "default" not in self.chat_templates:
            raise ParameterError("messages", (
                f"messages: this model has several chat templates and none named 'default': "
                f"{sorted(self.chat_templates)}"))
        return self.chat_templates["default"]


def chat_templates(model_dir: str | Path, tokenizer_config: Mapping) -> dict[str, str]:
    """The chat templates of a model directory by name, found as ``AutoTokenizer`` finds them.

    ``transformers`` 5 (``PreTrainedTokenizerBase._from_pretrained``) reads
    ``chat_template.jinja`` as the template named ``default`` and every
    ``additional_chat_templates/NAME.jinja`` as ``NAME``; when any of those files exists they
    replace the ``chat_template`` of ``tokenizer_config.json`` entirely. That key, used by
    checkpoints saved before the files existed, holds one template or a list of
    ``{"name", "template"}``. ``chat_template.json`` is a multimodal *processor's* legacy file
    (``ProcessorMixin``): for a text model neither ``AutoTokenizer`` nor vLLM reads it.
    """
    model_dir = Path(model_dir)
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((model_dir / "additional_chat_templates").glob("*.jinja")):
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    saved = tokenizer_config.get("chat_template")
    if isinstance(saved, list):
        return {entry["name"]: entry["template"] for entry in saved}
    return {"default": saved} if saved else {}


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """The template in the sandboxed Jinja environment ``transformers`` renders chats with.

    Compiled once per template text and kept, as ``transformers`` does, since a server renders
    the same template for every chat request. ``trim_blocks``/``lstrip_blocks`` drop the
    newline after a ``{% tag %}`` and the indent before it, so a template laid out on many
    lines renders without stray whitespace; ``tojson`` keeps non-ASCII text as it is (Jinja's
    own escapes HTML characters).
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _token_text(token) -> str | None:
    """``tokenizer_config.json`` stores special tokens as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token
