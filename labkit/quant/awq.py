"""AWQ: activation-aware weight quantization (Lin et al., 2024), in NumPy
(:doc:`chapter 4 </chapters/ch04_quantization>`).

A few input channels carry much larger activations than the rest, and the weights they
multiply matter most. AWQ scales those weight columns up before rounding (so they lose less
precision) and divides the activations by the same factors, which is exact in full precision:
``x W^T = (x / s)(W s)^T``. The factor per input channel is ``s = mean|x|^ratio``, normalised,
with ``ratio`` searched on a grid to minimise the layer's output error on calibration data;
then a clipping search shrinks each group's range where that helps. In a real model ``1/s`` is
folded into the previous operation (the RMSNorm weight, or the previous linear layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from labkit.checks import ParameterError
from labkit.quant.rtn import QuantizedTensor, quantize


@dataclass(frozen=True)
class AWQResult:
    """The chosen per-input-channel scales, clip ratios and the quantized ``W * s``."""

    scales: np.ndarray          # [in]; divide activations (or fold into the previous op)
    ratio: float                # the grid point that won
    clip: np.ndarray            # [out, groups] range shrink per group
    quantized: QuantizedTensor  # quantization of W * scales

    def dequantize(self) -> np.ndarray:
        """The effective weight: ``Q(W s) / s``, comparable with the original ``W``."""
        return self.quantized.dequantize() / self.scales[None, :]


def output_error(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    """Mean squared error of the layer output ``x W^T`` when ``W`` is replaced by ``w_hat``."""
    return float(np.mean((x @ w.T - x @ w_hat.T) ** 2))


def ratio_errors(weights: Sequence[np.ndarray], x: np.ndarray, bits: int = 4,
                 group_size: int = 128, grid: int = 20,
                 symmetric: bool = False) -> list[tuple[float, float, np.ndarray]]:
    """For each grid ratio: ``(ratio, summed output error, scales)``; ratio 0 is plain RTN."""
    x = np.asarray(x, np.float32)
    for w in weights:
        if x.ndim != 2 or x.shape[1] != w.shape[1]:
            raise ParameterError("x", f"x must be [tokens, {w.shape[1]}], got shape {x.shape}")
    x_mean = np.abs(x).mean(axis=0) + 1e-8
    results = []
    for ratio in np.arange(grid) / grid:
        s = x_mean ** ratio
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        err = sum(output_error(x, w, quantize(w * s, bits, symmetric, "group", group_size)
                               .dequantize() / s) for w in weights)
        results.append((float(ratio), err, s))
    return results


def search_scales(weights: Sequence[np.ndarray], x: np.ndarray, bits: int = 4,
                  group_size: int = 128, grid: int = 20,
                  symmetric: bool = False) -> tuple[np.ndarray, float]:
    """AWQ's scale search for layers that read the same input ``x [tokens, in]``.

    Layers sharing an input (q, k and v after the attention norm; gate and up after the MLP
    norm) must share the scales, so that ``1/s`` can be folded into the operation they share.
    Returns the scales and the winning ratio, chosen by the summed output error.
    """
    ratio, _, s = min(ratio_errors(weights, x, bits, group_size, grid, symmetric),
                      key=lambda r: r[1])
    return s, ratio


def awq_quantize(w: np.ndarray, x: np.ndarray, bits: int = 4, group_size: int = 128,
                 grid: int = 20, search_clip: bool = True,
                 symmetric: bool = False) -> AWQResult:
    """Quantize one layer ``w [out, in]`` with AWQ, on calibration activations ``x``."""
    w, x = np.asarray(w, np.float32), np.asarray(x, np.float32)
    s, ratio = search_scales([w], x, bits, group_size, grid, symmetric)
    clip = (search_clip_ratios(w * s, x / s, bits, group_size, symmetric) if search_clip
            else np.ones((w.shape[0], w.shape[1] // group_size), np.float32))
    return AWQResult(s, ratio, clip, quantize(w * s, bits, symmetric, "group", group_size, clip))


def search_clip_ratios(w: np.ndarray, x: np.ndarray, bits: int, group_size: int,
                       symmetric: bool = False, steps: int = 20,
                       min_ratio: float = 0.5) -> np.ndarray:
    """Per group, the range shrink in [min_ratio, 1] with the least output error."""
    out, inp = w.shape
    groups = inp // group_size
    xg = x.reshape(len(x), groups, group_size)
    wg = w.reshape(out, groups, group_size)
    reference = np.einsum("tgi,ogi->ogt", xg, wg)  # per (row, group) partial outputs
    best_err = np.full((out, groups), np.inf)
    best = np.ones((out, groups), np.float32)
    for ratio in np.linspace(1.0, min_ratio, steps):
        clip = np.full((out, groups), ratio, np.float32)
        deq = quantize(w, bits, symmetric, "group", group_size, clip).dequantize()
        partial = np.einsum("tgi,ogi->ogt", xg, deq.reshape(out, groups, group_size))
        err = np.mean((partial - reference) ** 2, axis=-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, ratio, best)
    return best
