"""Round-to-nearest integer quantization, and INT4 packing
(:doc:`chapter 4 </chapters/ch04_quantization>`).

A weight matrix ``W [out, in]`` is stored as integers ``q`` and a scale (and, asymmetric, a
zero point) per *group*: the whole tensor, one output channel (a row), or ``group_size``
consecutive input weights of a row (128 in AWQ and GPTQ checkpoints). Dequantized,
``W ~ scale * (q - zero)``. Symmetric quantization maps ``[-max|w|, max|w|]`` onto
``[-(2^(b-1) - 1), 2^(b-1) - 1]``; asymmetric maps ``[min(w, 0), max(w, 0)]`` onto
``[0, 2^b - 1]``, a range that always includes 0 so that zero stays exactly representable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.checks import ParameterError, positive_int
from labkit.units import cdiv

GRANULARITIES = ("tensor", "channel", "group")


@dataclass(frozen=True)
class QuantizedTensor:
    """Integers, scales and zero points of one quantized matrix ``[out, in]``."""

    q: np.ndarray          # integer codes (int16 holds every width), shape [out, in]
    scale: np.ndarray      # float32, shape [out, in // group_size]
    zero: np.ndarray       # integral zero points as float32, same shape (0 when symmetric)
    bits: int
    symmetric: bool
    group_size: int        # input weights per scale
    per_tensor: bool = False  # one scale for everything (stored per row for convenience)

    def dequantize(self) -> np.ndarray:
        """Back to float32: ``scale * (q - zero)``, group by group."""
        out, inp = self.q.shape
        q = self.q.astype(np.float32).reshape(out, -1, self.group_size)
        deq = (q - self.zero[..., None]) * self.scale[..., None]
        return deq.reshape(out, inp)

    @property
    def num_bytes(self) -> int:
        """Storage: packed codes plus a float16 scale (and a packed zero) per group."""
        groups = 1 if self.per_tensor else self.scale.size
        packed_bits = (self.q.size + (0 if self.symmetric else groups)) * self.bits
        return cdiv(packed_bits, 8) + 2 * groups


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integer codes of ``bits``-bit quantization: ``[-(2^(b-1) - 1), 2^(b-1) - 1]``
    symmetric, ``[0, 2^b - 1]`` asymmetric (chapter 4)."""
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)


def quant_params(lo: np.ndarray, hi: np.ndarray, bits: int,
                 symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scale and integral zero point of each group from its range ``[lo, hi]`` (chapter 4).

    The range is first widened to include 0, as llm-compressor (``calculate_qparams`` in
    compressed-tensors) does, so that 0 is always a code: a group of positive weights maps
    ``[0, max]`` onto the codes, not ``[min, max]``. Symmetric: ``scale = max|w| / qmax``,
    zero 0. Asymmetric: ``scale = (hi - lo) / (2^b - 1)``, zero ``round(-lo / scale)`` (the
    signed zero point of compressed-tensors plus ``2^(b-1)``). An all-zero group gets scale 1.
    """
    qmin, qmax = code_range(bits, symmetric)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    scale = (np.maximum(-lo, hi) if symmetric else hi - lo) / qmax
    scale = np.where(scale == 0, 1.0, scale)
    zero = np.zeros_like(scale) if symmetric else np.clip(np.rint(-lo / scale), qmin, qmax)
    return scale, zero


def check_group_size(width: int, group_size: int) -> int:
    """``group_size`` if it cuts rows of ``width`` input weights into whole groups, else raise
    (chapter 4)."""
    positive_int("group_size", group_size)
    if width % group_size:
        raise ParameterError("group_size", f"group_size ({group_size}) must divide the input "
                                           f"width ({width})")
    return group_size


def _group_size(w: np.ndarray, granularity: str, group_size: int) -> int:
    out, inp = w.shape
    if granularity == "tensor" or granularity == "channel":
        return inp
    if granularity != "group":
        raise ParameterError("granularity", f"granularity must be one of {GRANULARITIES}, got "
                                            f"{granularity!r}")
    return check_group_size(inp, group_size)


def quantize(w: np.ndarray, bits: int = 8, symmetric: bool = True, granularity: str = "channel",
             group_size: int = 128, clip: np.ndarray | float = 1.0) -> QuantizedTensor:
    """Round-to-nearest quantization of ``w [out, in]``.

    ``clip`` shrinks each group's range before rounding (AWQ's clipping search picks it):
    values beyond it saturate, and the rest get a finer grid.
    """
    if bits not in (2, 3, 4, 8):
        raise ParameterError("bits", f"bits must be 2, 3, 4 or 8, got {bits}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ParameterError("w", f"w must be a matrix [out, in], got shape {w.shape}")
    g = _group_size(w, granularity, group_size)
    out, inp = w.shape
    groups = w.reshape(out, inp // g, g)
    if granularity == "tensor":
        groups = w.reshape(1, 1, -1)
    clip = np.asarray(clip, dtype=np.float32)
    scale, zero = quant_params(groups.min(axis=-1) * clip, groups.max(axis=-1) * clip, bits,
                               symmetric)
    q = np.clip(np.rint(groups / scale[..., None]) + zero[..., None], *code_range(bits, symmetric))
    if granularity == "tensor":
        scale = np.full((out, 1), scale.item(), np.float32)
        zero = np.full((out, 1), zero.item(), np.float32)
    return QuantizedTensor(q.reshape(out, inp).astype(np.int16), scale.astype(np.float32),
                           zero.astype(np.float32), bits, symmetric, g,
                           per_tensor=granularity == "tensor")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (0..15, or -8..7) two per byte: even index low nibble, odd high."""
    q = np.asarray(q)
    if q.shape[-1] % 2:
        raise ParameterError("q", "q: the last dimension must be even to pack pairs")
    if q.min() < -8 or q.max() > 15:
        raise ParameterError("q", "q: codes must fit in 4 bits (-8..15)")
    nibbles = (q.astype(np.int16) & 0xF).astype(np.uint8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, signed: bool) -> np.ndarray:
    """Inverse of :func:`pack_int4`; ``signed`` restores -8..7 instead of 0..15."""
    packed = np.asarray(packed, dtype=np.uint8)
    low, high = packed & 0xF, packed >> 4
    q = np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int8)
    return np.where(q > 7, q - 16, q).astype(np.int8) if signed else q
