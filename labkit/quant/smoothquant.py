"""SmoothQuant: move activation outliers into the weights for W8A8 (Xiao et al., 2023)
(:ref:`ch04-fp8-smoothquant`).

INT8 activations fail on a few channels whose values are 100x the rest: one per-token scale
must cover them and the others lose all precision. SmoothQuant divides each input channel of
the activations by ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` and multiplies the matching
weight column by it, exact in full precision, so both become easy to quantize.
"""

from __future__ import annotations

import numpy as np

from labkit.checks import in_range
from labkit.quant.rtn import quantize


def smooth_scales(x: np.ndarray, w: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """Per input channel migration factors; ``alpha`` is how much difficulty moves to W."""
    in_range("alpha", alpha, 0, 1)
    act = np.abs(x).max(axis=0)
    weight = np.abs(w).max(axis=0)
    s = act ** alpha / np.maximum(weight, 1e-8) ** (1 - alpha)
    return np.where(act == 0, 1.0, np.maximum(s, 1e-8)).astype(np.float32)


def w8a8_output(x: np.ndarray, w: np.ndarray, smooth: np.ndarray | None = None) -> np.ndarray:
    """The layer output with INT8 weights (per output channel) and INT8 activations (dynamic,
    per token), after optional smoothing."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if smooth is not None:
        x, w = x / smooth, w * smooth
    w_hat = quantize(w, 8, True, "channel").dequantize()
    x_hat = quantize(x, 8, True, "channel").dequantize()  # rows of x are tokens
    return x_hat @ w_hat.T
