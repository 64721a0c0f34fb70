"""Model shapes and parameter counts, from a Hugging Face ``config.json`` (:ref:`ch01-what-fits`).

Counting parameters from the shape, rather than trusting the "8B" in a model's name, is what
lets the memory math separate weights that quantization shrinks (the linear layers) from those
it leaves alone (embeddings, LM head, norms), and total from active parameters in a
mixture-of-experts model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from labkit.checks import ParameterError, positive_int
from labkit.data import read_json

# Config keys of architectures whose memory this module does not model; better an error
# than a silently wrong count.
_UNSUPPORTED_KEYS = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek)",
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "sliding_window_pattern": "interleaved sliding-window layers",
}


@dataclass(frozen=True)
class ParamCount:
    """Parameters by role (:ref:`ch01-what-fits`). ``linear`` is what weight quantization
    applies to."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    router: int
    norms: int
    active_mlp: int

    @property
    def linear(self) -> int:
        """Parameters of the decoder blocks' linear layers (attention, MLP/experts, router)."""
        return self.attention + self.mlp + self.router

    @property
    def other(self) -> int:
        """Parameters kept in 16-bit by weight quantization: embedding, LM head, norms."""
        return self.embedding + self.lm_head + self.norms

    @property
    def total(self) -> int:
        return self.linear + self.other

    @property
    def active(self) -> int:
        """Parameters one token passes through (MoE: only its routed experts)."""
        return self.total - self.mlp + self.active_mlp


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer: Llama, Qwen2, Mixtral families
    (:ref:`ch01-what-fits`).

    ``num_experts == 1`` means a dense MLP. ``qkv_bias`` is True for Qwen2, which adds
    biases to the q, k and v projections; ``o_bias`` for Llama configs with ``attention_bias``.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 1
    experts_per_token: int = 1
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "vocab_size", "num_experts",
                      "experts_per_token"):
            positive_int(field, getattr(self, field))
        if self.num_attention_heads % self.num_kv_heads:
            raise ParameterError(
                "num_attention_heads",
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise ParameterError(
                "experts_per_token",
                f"experts_per_token ({self.experts_per_token}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.max_position_embeddings is not None:
            positive_int("max_position_embeddings", self.max_position_embeddings)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of K (or of V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim

    def param_counts(self) -> ParamCount:
        """Exact parameter counts by role, as ``transformers`` builds the model."""
        h, layers = self.hidden_size, self.num_layers
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attention += h
        expert = 3 * h * self.intermediate_size  # gate, up and down projections
        router = h * self.num_experts if self.is_moe else 0
        embedding = self.vocab_size * h
        return ParamCount(
            embedding=embedding,
            lm_head=0 if self.tie_word_embeddings else embedding,
            attention=layers * attention,
            mlp=layers * expert * self.num_experts,
            router=layers * router,
            norms=layers * 2 * h + h,  # two RMSNorms per block and the final one
            active_mlp=layers * expert * self.experts_per_token,
        )

    @property
    def num_params(self) -> int:
        return self.param_counts().total

    @property
    def num_active_params(self) -> int:
        return self.param_counts().active

    @classmethod
    def from_hf_config(cls, config: str | Path | Mapping[str, Any],
                       name: str | None = None) -> ModelSpec:
        """Build a spec from a Hugging Face ``config.json``: a file, a model directory or a dict."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ParameterError("config", f"config: no config.json at {path}")
            with path.open(encoding="utf-8") as f:
                config = json.load(f)
            name = name or path.parent.name
        if not isinstance(config, Mapping):
            raise ParameterError("config", f"config must be a path or a mapping, got "
                                           f"{type(config).__name__}")
        if "text_config" in config:  # multimodal wrappers keep the language model inside
            config = config["text_config"]
        for key, what in _UNSUPPORTED_KEYS.items():
            if config.get(key):
                raise ParameterError("config", f"config uses {what} ({key!r}), which ModelSpec "
                                               f"does not model")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in config]
        if missing:
            raise ParameterError("config", f"config is missing required keys: "
                                           f"{', '.join(missing)}")
        heads = config["num_attention_heads"]
        num_experts = config.get("num_local_experts") or config.get("num_experts") or 1
        is_qwen2 = config.get("model_type") == "qwen2"
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            name=name or config.get("_name_or_path") or config.get("model_type", "model"),
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_experts=num_experts,
            experts_per_token=config.get("num_experts_per_tok", 1) if num_experts > 1 else 1,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            max_position_embeddings=config.get("max_position_embeddings"),
        )

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """One of the course's preset models, e.g. ``ModelSpec.preset("Llama-3-70B")``."""
        record = preset_record(name)
        return cls.from_hf_config(record["config"], name=record["name"])


@lru_cache(maxsize=1)
def _presets() -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in read_json("models.json")["models"]}


def preset_names() -> list[str]:
    """Names of the preset models, e.g. ``["Llama-3-8B", ...]``."""
    return list(_presets())


def preset_record(name: str) -> dict[str, Any]:
    """The preset's data row: HF repo, config, published parameter count and its source."""
    for key, record in _presets().items():
        if key.lower() == name.lower():
            return record
    raise ParameterError("model", f"model: unknown model preset {name!r}; known: "
                                  f"{', '.join(_presets())}")


def get_model(model: str | ModelSpec) -> ModelSpec:
    """A ``ModelSpec`` as is, or the preset of that name."""
    return model if isinstance(model, ModelSpec) else ModelSpec.preset(model)
