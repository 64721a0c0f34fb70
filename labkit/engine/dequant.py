"""Dequantize quantized checkpoints on load (:ref:`ch04-choosing`): llm-compressor's and
AutoAWQ's.

llm-compressor writes compressed-tensors checkpoints, in three formats:

- ``pack-quantized`` (W4A16, GPTQ and AWQ): ``weight_packed`` holds eight 4-bit codes per
  int32, lowest bits first, each stored with an offset of 8 (code ``q`` in [-8, 7] is stored as
  ``q + 8``); ``weight_scale`` has one scale per group of input columns; asymmetric schemes add
  ``weight_zero_point``, packed the same way but along the output dimension.
- ``int-quantized`` (W8A8): ``weight`` is int8, ``weight_scale`` one per output channel.
- ``float-quantized`` (FP8): ``weight`` is float8 E4M3, ``weight_scale`` per channel or tensor.

AutoAWQ (``quant_method: awq``, GEMM version) stores ``qweight [in, out/8]`` and ``qzeros``
as int32 words holding eight 4-bit values in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (so
its kernel can unpack pairs cheaply), and ``scales [in/group, out]`` in float16; the layer's
weight is the transpose of ``(q - zero) * scale``.

The weight is ``(q - zero) * scale``. Activation quantization (W8A8's per-token INT8, FP8
dynamic) is a kernel's business; the teaching engine keeps activations in float32.
"""

from __future__ import annotations

import numpy as np

from labkit.checks import ParameterError

SUPPORTED = ("pack-quantized", "int-quantized", "float-quantized")


def unpack_int32(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """Codes packed ``32 // bits`` per int32 along the last axis, offset removed (signed)."""
    per_word = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per_word, dtype=np.int64) * bits
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return (codes.reshape(*packed.shape[:-1], -1) - (1 << (bits - 1))).astype(np.int16)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def dequantize(tensors: dict[str, np.ndarray], quantization_config: dict) -> dict[str, np.ndarray]:
    """Replace every quantized layer's tensors by a float32 ``.weight``."""
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return dequantize_compressed_tensors(tensors, quantization_config)
    if method == "awq":
        return dequantize_awq(tensors, quantization_config)
    raise ParameterError("quantization_config", f"quantization_config: quant_method {method!r} "
                                                f"is not supported: use llm-compressor's "
                                                f"compressed-tensors format or AutoAWQ's")


def dequantize_awq(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM checkpoints: ``qweight``, ``qzeros`` and ``scales`` per layer."""
    if config.get("version", "gemm").lower() != "gemm" or config.get("bits") != 4:
        raise ParameterError("config", "config: only AutoAWQ's 4-bit GEMM format is supported")
    group = config["group_size"]
    order = np.argsort(AWQ_ORDER)  # column c sits in nibble order[c % 8]
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".qweight")]:
        prefix = name[: -len(".qweight")]
        q = _unpack_awq(out.pop(name), order)
        zeros = _unpack_awq(out.pop(prefix + ".qzeros"), order)
        scales = out.pop(prefix + ".scales").astype(np.float32)
        weight = (q - np.repeat(zeros, group, axis=0)) * np.repeat(scales, group, axis=0)
        out[prefix + ".weight"] = np.ascontiguousarray(weight.T)
    return out


def _unpack_awq(packed: np.ndarray, order: np.ndarray) -> np.ndarray:
    words = packed.astype(np.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> (np.arange(8) * 4)) & 0xF  # [rows, words, 8], nibble order
    return nibbles[..., order].reshape(packed.shape[0], -1).astype(np.float32)


def dequantize_compressed_tensors(tensors: dict[str, np.ndarray],
                                  quantization_config: dict) -> dict[str, np.ndarray]:
    """llm-compressor's formats; see the module docstring."""
    fmt = quantization_config.get("format")
    if fmt not in SUPPORTED:
        raise ParameterError("quantization_config", f"quantization_config: compressed-tensors "
                                                    f"format {fmt!r} is not supported "
                                                    f"({SUPPORTED})")
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        prefix = name[: -len(".weight_scale")]
        scale = out.pop(name).astype(np.float32)
        zero = out.pop(prefix + ".weight_zero_point", None)
        if prefix + ".weight_packed" in out:
            shape = tuple(out.pop(prefix + ".weight_shape"))
            q = unpack_int32(out.pop(prefix + ".weight_packed"))[:, : shape[1]]
            if zero is not None:  # packed along the output dimension
                zero = unpack_int32(zero.T).T[: shape[0]]
        else:
            q = out.pop(prefix + ".weight")
        rows, cols = q.shape
        scale = scale.reshape(rows if scale.size > 1 else 1, -1)  # [rows or 1, groups]
        zero = (np.zeros_like(scale) if zero is None
                else np.asarray(zero, np.float32).reshape(scale.shape))
        groups = q.astype(np.float32).reshape(rows, scale.shape[1], -1)
        weight = (groups - zero[..., None]) * scale[..., None]
        out[prefix + ".weight"] = weight.reshape(rows, cols)
    return out
