"""FP8 (E4M3 and E5M2) quantization through ``ml_dtypes`` (:ref:`ch04-fp8-smoothquant`).

FP8 keeps a float's shape with 8 bits: E4M3 has 3 mantissa bits and a largest finite value of
448, E5M2 has 2 and reaches 57344. Neither has room for a typical activation outlier, and a
plain cast does not saturate: ``float8_e4m3fn(1000.0)`` is NaN. Scales exist so values land
inside the range: divide by ``amax / 448`` (per tensor, per output channel, or dynamically per
token), cast, and multiply back after the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from labkit.checks import ParameterError

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
SCHEMES = ("tensor", "channel", "token")


def fp8_max(fmt: str = "e4m3") -> float:
    """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(ml_dtypes.finfo(_dtype(fmt)).max)


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 values and the float32 scales that bring them back."""

    values: np.ndarray  # ml_dtypes float8 array
    scale: np.ndarray   # float32, broadcastable against values
    fmt: str

    def dequantize(self) -> np.ndarray:
        return self.values.astype(np.float32) * self.scale


def quantize_fp8(x: np.ndarray, fmt: str = "e4m3", scheme: str = "tensor") -> FP8Tensor:
    """Scale ``x`` into the format's range and cast, saturating at its largest value.

    ``scheme``: one scale for the ``tensor``; one per row (``channel``, a weight's output
    channel); or one per row computed on the fly (``token``, for activations, "dynamic").
    """
    if scheme not in SCHEMES:
        raise ParameterError("scheme", f"scheme must be one of {SCHEMES}, got {scheme!r}")
    x = np.asarray(x, dtype=np.float32)
    if scheme == "tensor":
        amax = np.abs(x).max(keepdims=True)
    else:
        if x.ndim != 2:
            raise ParameterError("x", f"x must be a matrix for per-{scheme} scaling, got shape "
                                      f"{x.shape}")
        amax = np.abs(x).max(axis=1, keepdims=True)
    top = fp8_max(fmt)
    scale = np.where(amax == 0, 1.0, amax / top).astype(np.float32)
    values = np.clip(x / scale, -top, top).astype(_dtype(fmt))
    return FP8Tensor(values, scale, fmt)


def _dtype(fmt: str):
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ParameterError("fmt", f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}") from None
