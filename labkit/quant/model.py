"""Quantize a whole checkpoint's linear layers and measure what it costs (:ref:`ch04-choosing`).

Calibration runs the full-precision teaching model (:mod:`labkit.engine`) over a few token
sequences and records the input of every linear layer. Each layer is then quantized with the
chosen method and written back *dequantized* ("fake quantization"): the checkpoint stays a
normal float32 directory any engine loads, and the numbers it computes are the quantized
model's. Embeddings, norms and the LM head are left alone, as AWQ and GPTQ leave them.
Tools such as llm-compressor calibrate layer by layer on the already-quantized model; this
simpler version calibrates every layer on full-precision inputs.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from labkit.checks import ParameterError
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.weights import load_checkpoint
from labkit.hardware.kv_budget import check_sequence_fits
from labkit.quant.awq import search_clip_ratios, search_scales
from labkit.quant.fp8 import quantize_fp8
from labkit.quant.gptq import gptq_quantize
from labkit.quant.rtn import quantize
from labkit.units import cdiv

METHODS = ("rtn-int8", "rtn-int4", "awq-int4", "gptq-int4", "fp8")


def _run(model: LlamaModel, token_ids: Sequence[int], observe=None) -> np.ndarray:
    """Logits of one whole sequence (a throwaway block table over a fresh cache)."""
    bs = model.kv[0].block_size
    check_sequence_fits(len(token_ids), len(model.kv[0].k), bs,
                        f"a sequence of {len(token_ids)} tokens")
    blocks = list(range(cdiv(len(token_ids), bs)))
    return model.forward([SequenceBatch(token_ids, 0, blocks)], observe)[0]


def _load(model_dir: str | Path, max_len: int) -> LlamaModel:
    return LlamaModel.load(model_dir, num_blocks=cdiv(max_len, 16), block_size=16)


def calibrate(model_dir: str | Path, sequences: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Inputs of every linear layer over ``sequences``, concatenated ``[tokens, in]``."""
    model = _load(model_dir, max(len(s) for s in sequences))
    seen: dict[str, list[np.ndarray]] = defaultdict(list)
    for seq in sequences:
        _run(model, seq, lambda name, x: seen[name].append(x.copy()))
    return {name: np.concatenate(xs) for name, xs in seen.items()}


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, method: str,
                        calibration: Sequence[Sequence[int]] = (),
                        group_size: int = 128) -> Path:
    """Write a fake-quantized copy of ``model_dir`` to ``out_dir`` with ``method``.

    ``method`` is one of ``rtn-int8`` (per channel), ``rtn-int4``, ``awq-int4``, ``gptq-int4``
    (group-wise, asymmetric) or ``fp8`` (E4M3, per channel). AWQ and GPTQ need calibration
    token sequences.
    """
    from safetensors.numpy import save_file

    if method not in METHODS:
        raise ParameterError("method", f"method must be one of {METHODS}, got {method!r}")
    if method in ("awq-int4", "gptq-int4") and not calibration:
        raise ParameterError("calibration", f"calibration: {method} needs calibration "
                                            f"sequences")
    weights = load_checkpoint(model_dir)
    inputs = calibrate(model_dir, calibration) if calibration else {}
    if method == "awq-int4":
        apply_awq_scales(weights, inputs, group_size)
    for name in [n for n in weights if n.endswith("_proj.weight") and ".layers." in n]:
        w, layer = weights[name], name[: -len(".weight")]
        if method == "rtn-int8":
            weights[name] = quantize(w, 8, True, "channel").dequantize()
        elif method == "rtn-int4":
            weights[name] = quantize(w, 4, False, "group", group_size).dequantize()
        elif method == "awq-int4":
            clip = search_clip_ratios(w, inputs[layer], 4, group_size)
            weights[name] = quantize(w, 4, False, "group", group_size, clip).dequantize()
        elif method == "gptq-int4":
            weights[name] = gptq_quantize(w, inputs[layer], 4, group_size).weight
        else:
            weights[name] = quantize_fp8(w, "e4m3", "channel").dequantize()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in Path(model_dir).iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, out_dir / file.name)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
              str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["labkit_fake_quantization"] = method
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def apply_awq_scales(weights: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                     group_size: int = 128) -> None:
    """AWQ's scaling, folded into the model in place: exact before any rounding.

    Each group of layers reading one input gets shared scales ``s``: their weights' input
    columns are multiplied by ``s`` and ``1/s`` goes into what produced the input: the RMSNorm
    weight for q/k/v and for gate/up, the rows of up_proj for down_proj (the MLP multiplies by
    up's output), and the rows of v_proj for o_proj when their shapes match (with grouped-query
    attention they do not, and AWQ skips that pair). ``inputs`` are rescaled to match.
    """
    layers = sorted({int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")})
    for i in layers:
        p = f"model.layers.{i}."
        groups = [(p + "input_layernorm.weight", [p + "self_attn.q_proj", p + "self_attn.k_proj",
                                                  p + "self_attn.v_proj"]),
                  (p + "post_attention_layernorm.weight", [p + "mlp.gate_proj", p + "mlp.up_proj"]),
                  (p + "mlp.up_proj.weight", [p + "mlp.down_proj"])]
        v, o = weights[p + "self_attn.v_proj.weight"], weights[p + "self_attn.o_proj.weight"]
        if v.shape == o.shape:
            groups.append((p + "self_attn.v_proj.weight", [p + "self_attn.o_proj"]))
        for previous, readers in groups:
            x = inputs[readers[0]]
            s, _ = search_scales([weights[r + ".weight"] for r in readers], x, 4, group_size)
            for r in readers:
                weights[r + ".weight"] = weights[r + ".weight"] * s[None, :]
                inputs[r] = x / s
            prev = weights[previous]
            weights[previous] = prev / s if prev.ndim == 1 else prev / s[:, None]
            bias = previous.replace(".weight", ".bias")
            if bias in weights:
                weights[bias] = weights[bias] / s


def perplexity(model_dir: str | Path, sequences: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood of each next token) over ``sequences``."""
    model = _load(model_dir, max(len(s) for s in sequences))
    nll, count = 0.0, 0
    for seq in sequences:
        logits = _run(model, seq).astype(np.float64)[:-1]
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll -= logp[np.arange(len(seq) - 1), np.asarray(seq[1:])].sum()
        count += len(seq) - 1
    return float(np.exp(nll / count))


def logit_error(reference_dir: str | Path, model_dir: str | Path,
                sequences: Sequence[Sequence[int]]) -> float:
    """Root-mean-square difference of the two models' logits over ``sequences``."""
    longest = max(len(s) for s in sequences)
    ref, other = _load(reference_dir, longest), _load(model_dir, longest)
    diffs = [(_run(ref, s) - _run(other, s)) ** 2 for s in sequences]
    return float(np.sqrt(np.mean(np.concatenate(diffs))))
