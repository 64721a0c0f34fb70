"""A Llama-family decoder in NumPy whose attention reads a paged KV cache
(chapter 2, :ref:`ch03-paged-attention`).

RMSNorm, rotary position embeddings (theta and scaling as the config sets them), grouped-query
attention through :func:`labkit.attention.paged_attention`, and the SwiGLU MLP; Qwen2's q/k/v
biases and tied embeddings are read when the checkpoint has them. It computes in float32 and
matches ``transformers``' ``LlamaForCausalLM`` on the same weights (a test checks the logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.attention import PagedKVStore, batched_paged_attention, paged_attention
from labkit.checks import ParameterError
from labkit.engine.weights import load_checkpoint
from labkit.hardware import ModelSpec


@dataclass(frozen=True)
class SequenceBatch:
    """One sequence's part of a step: its new tokens, where they start, and its block table.

    ``all_logits`` asks for logits at every new token (prompt logprobs, tests); otherwise
    only the last token's are computed, the one the engine samples from, as vLLM does.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    all_logits: bool = True


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's weights, transposed to ``[in, out]`` so every linear layer is ``x @ w``.

    As in vLLM (``QKVParallelLinear``, ``MergedColumnParallelLinear``), the projections that
    read the same input are stacked into one matrix: one matrix product instead of three
    (q, k, v) or two (gate, up), so each step makes fewer, larger calls.
    """

    input_norm: np.ndarray
    qkv: np.ndarray
    qkv_bias: np.ndarray | None
    o_proj: np.ndarray
    post_norm: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray

    @classmethod
    def from_checkpoint(cls, w: dict[str, np.ndarray]) -> DecoderLayer:
        """From one layer's checkpoint tensors, named as in ``transformers`` (``[out, in]``)."""
        qkv = [f"self_attn.{p}_proj" for p in "qkv"]
        biases = [w.get(name + ".bias") for name in qkv]
        return cls(
            input_norm=w["input_layernorm.weight"],
            qkv=_stack_transposed([w[name + ".weight"] for name in qkv]),
            qkv_bias=None if biases[0] is None else np.concatenate(biases),
            o_proj=_stack_transposed([w["self_attn.o_proj.weight"]]),
            post_norm=w["post_attention_layernorm.weight"],
            gate_up=_stack_transposed([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]),
            down=_stack_transposed([w["mlp.down_proj.weight"]]))

    @property
    def tensors(self) -> list[np.ndarray]:
        return [t for t in vars(self).values() if t is not None]


class LlamaModel:
    """Weights, rotary tables and one paged K/V store per layer."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray], num_blocks: int,
                 block_size: int) -> None:
        if config.get("model_type") not in ("llama", "qwen2", "mistral"):
            raise ParameterError("config", f"config: model_type {config.get('model_type')!r} is "
                                           f"not a Llama-family model this engine runs "
                                           f"(llama, qwen2 or mistral)")
        self.spec = ModelSpec.from_hf_config(config)
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.inv_freq = _rope_inv_freq(config, self.spec.head_dim)
        self.embed = weights["model.embed_tokens.weight"]
        # Tied when absent; transposed once, so the last matrix product is a plain x @ w too.
        self.lm_head = np.ascontiguousarray(weights.get("lm_head.weight", self.embed).T)
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer.from_checkpoint(
            {key.split(f"layers.{i}.", 1)[1]: value for key, value in weights.items()
             if f"layers.{i}." in key}) for i in range(self.spec.num_layers)]
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
        tensors = [self.embed, self.norm] + [t for layer in self.layers for t in layer.tensors]
        if not np.shares_memory(self.lm_head, self.embed):
            tensors.append(self.lm_head)
        return sum(t.nbytes for t in tensors)

    def forward(self, batch: Sequence[SequenceBatch],
                observe: Callable[[str, np.ndarray], None] | None = None) -> list[np.ndarray]:
        """Logits for each sequence (``[new_tokens, vocab]``, or ``[1, vocab]`` for the last
        token unless ``all_logits``); writes their K/V to the cache.

        The whole step is one batch, as in vLLM: every new token of every sequence is a row
        of one ``[tokens, hidden]`` matrix, so each weight matrix is read once per step
        however many sequences run. Only attention looks at sequences: the decodes (one new
        token each) attend together in one call, each prefill chunk in its own.

        ``observe(name, x)``, if given, sees the input of every linear layer (named as in the
        checkpoint, e.g. ``model.layers.0.mlp.down_proj``): calibration for chapter 4.
        """
        spec, store0 = self.spec, self.kv[0]
        lengths = [len(s.token_ids) for s in batch]
        tokens = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in batch])
        positions = np.concatenate([np.arange(s.start, s.start + n)
                                    for s, n in zip(batch, lengths, strict=True)])
        # Where each token's K/V goes, worked out once for all layers (same tables in each).
        slots = np.concatenate([store0.slot_mapping(s.block_table, s.start, s.start + n)
                                for s, n in zip(batch, lengths, strict=True)])
        offsets = np.cumsum([0] + lengths)
        decodes = [i for i, n in enumerate(lengths) if n == 1]
        prefills = [i for i, n in enumerate(lengths) if n > 1]
        cos, sin = self._rope_tables(positions)
        x = self.embed[tokens]
        for index, (layer, store) in enumerate(zip(self.layers, self.kv, strict=True)):
            prefix = f"model.layers.{index}."
            h = _rms_norm(x, layer.input_norm, self.eps)
            _observe(observe, prefix, ("self_attn.q_proj", "self_attn.k_proj",
                                       "self_attn.v_proj"), h)
            qkv = h @ layer.qkv
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q_width = spec.num_attention_heads * spec.head_dim
            q = qkv[:, :q_width].reshape(len(x), spec.num_attention_heads, -1)
            k, v = np.split(qkv[:, q_width:].reshape(len(x), 2 * spec.num_kv_heads, -1), 2,
                            axis=1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            store.write_slots(slots, k, v)
            attn = np.empty_like(q)
            if decodes:
                rows = offsets[decodes]
                attn[rows] = batched_paged_attention(
                    q[rows, None], store, [batch[i].block_table for i in decodes],
                    [batch[i].start + 1 for i in decodes])[:, 0]
            for i in prefills:
                rows = slice(offsets[i], offsets[i + 1])
                attn[rows] = paged_attention(q[rows], store, batch[i].block_table,
                                             batch[i].start + lengths[i])
            attn = attn.reshape(len(x), -1)
            _observe(observe, prefix, ("self_attn.o_proj",), attn)
            x = x + attn @ layer.o_proj
            h = _rms_norm(x, layer.post_norm, self.eps)
            _observe(observe, prefix, ("mlp.gate_proj", "mlp.up_proj"), h)
            gate, up = np.split(h @ layer.gate_up, 2, axis=1)
            act = gate / (1 + np.exp(-gate)) * up
            _observe(observe, prefix, ("mlp.down_proj",), act)
            x = x + act @ layer.down
        # Logits only where someone reads them: the LM head is the largest matrix of a small
        # model, and a prefill chunk needs just its last row.
        keep = np.concatenate([np.arange(offsets[i] if s.all_logits else offsets[i + 1] - 1,
                                         offsets[i + 1]) for i, s in enumerate(batch)])
        logits = _rms_norm(x[keep], self.norm, self.eps) @ self.lm_head
        counts = [n if s.all_logits else 1 for s, n in zip(batch, lengths, strict=True)]
        return np.split(logits, np.cumsum(counts)[:-1])

    def _rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [tokens, 1, head_dim]
        return np.cos(emb), np.sin(emb)


def _stack_transposed(weights: list[np.ndarray]) -> np.ndarray:
    """``[out, in]`` matrices stacked along ``out`` and stored as one contiguous ``[in, out]``."""
    return np.ascontiguousarray(np.concatenate(weights).T)


def _observe(observe: Callable[[str, np.ndarray], None] | None, prefix: str,
             names: Sequence[str], x: np.ndarray) -> None:
    if observe is not None:
        for name in names:
            observe(prefix + name, x)


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
