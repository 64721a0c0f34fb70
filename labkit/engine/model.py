"""A Llama-family decoder in NumPy whose attention reads a paged KV cache (chapter 2.1).

RMSNorm, rotary position embeddings (theta and scaling as the config sets them), grouped-query
attention through :func:`labkit.attention.paged_attention`, and the SwiGLU MLP; Qwen2's q/k/v
biases and tied embeddings are read when the checkpoint has them. It computes in float32 and
matches ``transformers``' ``LlamaForCausalLM`` on the same weights (a test checks the logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from labkit.attention import PagedKVStore, paged_attention
from labkit.checks import ParameterError
from labkit.engine.weights import load_checkpoint
from labkit.hardware import ModelSpec


@dataclass(frozen=True)
class SequenceBatch:
    """One sequence's part of a step: its new tokens, where they start, and its block table."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


class LlamaModel:
    """Weights, rotary tables and one paged K/V store per layer."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray], num_blocks: int,
                 block_size: int) -> None:
        if config.get("model_type") not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"model_type {config.get('model_type')!r} is not a Llama-family "
                             f"model this engine runs")
        self.spec = ModelSpec.from_hf_config(config)
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.inv_freq = _rope_inv_freq(config, self.spec.head_dim)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)  # tied when absent
        self.norm = weights["model.norm.weight"]
        self.layers = [{key.split(f"layers.{i}.", 1)[1]: value for key, value in weights.items()
                        if f"layers.{i}." in key} for i in range(self.spec.num_layers)]
        self.allocate_kv_cache(num_blocks, block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """(Re)create one paged K/V store per layer, e.g. once the engine has sized the cache."""
        self.kv = [PagedKVStore(num_blocks, block_size, self.spec.num_kv_heads,
                                self.spec.head_dim) for _ in range(self.spec.num_layers)]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` in every layer (a forked sequence's partial block)."""
        for store in self.kv:
            store.copy_blocks(copies)

    @classmethod
    def load(cls, model_dir: str | Path, num_blocks: int, block_size: int) -> LlamaModel:
        import json

        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(config, load_checkpoint(model_dir), num_blocks, block_size)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + [w for layer in self.layers for w in layer.values()]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        return sum(t.nbytes for t in tensors)

    def forward(self, batch: Sequence[SequenceBatch],
                observe: Callable[[str, np.ndarray], None] | None = None) -> list[np.ndarray]:
        """Logits ``[new_tokens, vocab]`` for each sequence; writes their K/V to the cache.

        ``observe(name, x)``, if given, sees the input of every linear layer (named as in the
        checkpoint, e.g. ``model.layers.0.mlp.down_proj``): calibration for chapter 4.
        """
        spec = self.spec
        tokens = np.concatenate([np.asarray(s.token_ids) for s in batch])
        positions = np.concatenate([np.arange(s.start, s.start + len(s.token_ids))
                                    for s in batch])
        cos, sin = self._rope_tables(positions)
        x = self.embed[tokens]
        for index, (layer, store) in enumerate(zip(self.layers, self.kv, strict=True)):
            linear = partial(_observed_linear, layer=layer, prefix=f"model.layers.{index}.",
                             observe=observe)
            h = _rms_norm(x, layer["input_layernorm.weight"], self.eps)
            q = linear(h, "self_attn.q_proj").reshape(len(x), spec.num_attention_heads, -1)
            k = linear(h, "self_attn.k_proj").reshape(len(x), spec.num_kv_heads, -1)
            v = linear(h, "self_attn.v_proj").reshape(len(x), spec.num_kv_heads, -1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            outputs, offset = [], 0
            for seq in batch:
                n = len(seq.token_ids)
                store.write(seq.block_table, seq.start, k[offset:offset + n], v[offset:offset + n])
                outputs.append(paged_attention(q[offset:offset + n], store, seq.block_table,
                                               seq.start + n))
                offset += n
            attn = np.concatenate(outputs).reshape(len(x), -1).astype(np.float32)
            x = x + linear(attn, "self_attn.o_proj")
            h = _rms_norm(x, layer["post_attention_layernorm.weight"], self.eps)
            gate, up = linear(h, "mlp.gate_proj"), linear(h, "mlp.up_proj")
            x = x + linear(gate / (1 + np.exp(-gate)) * up, "mlp.down_proj")
        logits = _rms_norm(x, self.norm, self.eps) @ self.lm_head.T
        return np.split(logits, np.cumsum([len(s.token_ids) for s in batch])[:-1])

    def _rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [tokens, 1, head_dim]
        return np.cos(emb), np.sin(emb)


def _observed_linear(x: np.ndarray, name: str, *, layer: dict[str, np.ndarray], prefix: str,
                     observe: Callable[[str, np.ndarray], None] | None) -> np.ndarray:
    if observe is not None:
        observe(prefix + name, x)
    return _linear(x, layer, name)


def _linear(x: np.ndarray, layer: dict[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ layer[name + ".weight"].T
    bias = layer.get(name + ".bias")
    return y + bias if bias is not None else y


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _rope_inv_freq(config: dict, head_dim: int) -> np.ndarray:
    """Rotary frequencies ``theta ** (-2i / head_dim)``, with theta and scaling from the config.

    Theta sets the slowest rotation: Llama 2 used 10,000, Llama 3 uses 500,000 and Qwen2.5
    1,000,000, so that far-apart positions still look different. A wrong theta fails
    silently: the angles are off, a little between near tokens and much between far ones, and
    the text just gets worse. So it must be read right, and it moved:
    ``transformers`` 5 (``RotaryEmbeddingConfigMixin`` in ``modeling_rope_utils.py``) saves
    every RoPE setting in one dict, ``rope_parameters`` (``rope_type``, ``rope_theta`` and the
    scaling keys), where older configs have a top-level ``rope_theta`` and a ``rope_scaling``
    dict. As there, ``rope_scaling`` wins when both dicts are present, and theta comes from
    the dict, else the top level, else is 10,000. Scaling stretches the context a model was
    trained on: ``linear`` divides every frequency by ``factor``; Llama 3.1's ``llama3``
    divides only the low ones (long wavelengths) and blends in between.
    """
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(key) or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "default":
        return inv_freq.astype(np.float32)
    if kind == "linear":
        return (inv_freq / params["factor"]).astype(np.float32)
    if kind != "llama3":
        raise ParameterError(key, f"{key}: rope_type {kind!r} is not supported by the teaching "
                                  f"engine; it runs 'default', 'linear' and 'llama3'")
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    # A top-level original_max_position_embeddings wins over the dict's (transformers' rule).
    old_ctx = config.get("original_max_position_embeddings",
                         params.get("original_max_position_embeddings",
                                    config["max_position_embeddings"]))
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
