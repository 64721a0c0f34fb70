"""Dequantize llm-compressor checkpoints (compressed-tensors) on load (chapter 4.5).

Three formats cover what chapter 4 produces:

- ``pack-quantized`` (W4A16, GPTQ and AWQ): ``weight_packed`` holds eight 4-bit codes per
  int32, lowest bits first, each stored with an offset of 8 (code ``q`` in [-8, 7] is stored as
  ``q + 8``); ``weight_scale`` has one scale per group of input columns; asymmetric schemes add
  ``weight_zero_point``, packed the same way but along the output dimension.
- ``int-quantized`` (W8A8): ``weight`` is int8, ``weight_scale`` one per output channel.
- ``float-quantized`` (FP8): ``weight`` is float8 E4M3, ``weight_scale`` per channel or tensor.

The weight is ``(q - zero) * scale``. Activation quantization (W8A8's per-token INT8, FP8
dynamic) is a kernel's business; the teaching engine keeps activations in float32.
"""

from __future__ import annotations

import numpy as np

SUPPORTED = ("pack-quantized", "int-quantized", "float-quantized")


def unpack_int32(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """Codes packed ``32 // bits`` per int32 along the last axis, offset removed (signed)."""
    per_word = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per_word, dtype=np.int64) * bits
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return (codes.reshape(*packed.shape[:-1], -1) - (1 << (bits - 1))).astype(np.int16)


def dequantize_compressed_tensors(tensors: dict[str, np.ndarray],
                                  quantization_config: dict) -> dict[str, np.ndarray]:
    """Replace every quantized layer's tensors by a float32 ``.weight``."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        raise ValueError(f"quantization method {quantization_config.get('quant_method')!r} "
                         f"is not supported; use llm-compressor's compressed-tensors format")
    fmt = quantization_config.get("format")
    if fmt not in SUPPORTED:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({SUPPORTED})")
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
