"""GPTQ: quantization with second-order error feedback (Frantar et al., 2023), in NumPy
(:ref:`ch04-gptq`).

Quantizing a weight column introduces an error; GPTQ spreads it over the columns not yet
quantized, in proportion to how the calibration inputs correlate them. With ``H = 2 X^T X``
(the Hessian of the layer's squared output error), after column ``i`` is rounded the remaining
columns move by ``-(w_i - q_i) / [H^-1]_ii * [H^-1]_i,j``. It works on the Cholesky factor of
``H^-1`` (numerically stable, computed once), updates lazily in blocks of columns, computes a
group's scale when the group starts, and can visit columns in order of decreasing
``diag(H)`` ("activation order", ``act_order``), most important first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.checks import ParameterError, in_range
from labkit.quant.rtn import check_group_size, code_range, quant_params


@dataclass(frozen=True)
class GPTQResult:
    """Dequantized weights, codes and group parameters, in the original column order."""

    weight: np.ndarray   # [out, in] float32, what the quantized layer computes with
    q: np.ndarray        # [out, in] integer codes
    scales: np.ndarray   # [out, groups]
    zeros: np.ndarray    # [out, groups]
    g_idx: np.ndarray    # [in] group of each input column (matters with act_order)


def gptq_quantize(w: np.ndarray, x: np.ndarray, bits: int = 4, group_size: int = 128,
                  damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                  symmetric: bool = False, static_groups: bool = False) -> GPTQResult:
    """Quantize ``w [out, in]`` with GPTQ on calibration activations ``x [tokens, in]``.

    ``static_groups`` takes every group's scale from the original weights before any update
    (as llm-compressor and AutoGPTQ's ``static_groups`` do) instead of from the updated
    weights when the group starts (the paper's reference code).
    """
    w = np.array(w, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    out, inp = w.shape
    if x.ndim != 2 or x.shape[1] != inp:
        raise ParameterError("x", f"x must be [tokens, {inp}], got shape {x.shape}")
    check_group_size(inp, group_size)
    in_range("damp", damp, 0, 1, low_open=True, high_open=True)
    h = 2 * x.T @ x / len(x)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(inp)
    w, h = w[:, perm], h[np.ix_(perm, perm)]
    h[np.diag_indices(inp)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1

    qmin, qmax = code_range(bits, symmetric)
    codes = np.zeros((out, inp), np.int64)
    deq = np.zeros((out, inp))
    scales = np.zeros((out, inp // group_size))
    zeros = np.zeros((out, inp // group_size))
    if static_groups:
        for g in range(inp // group_size):
            columns = (np.arange(inp) // group_size)[perm] == g  # group g's columns, permuted
            scales[:, g], zeros[:, g] = _params(w[:, columns], bits, symmetric)
    group_of = (np.arange(inp) // group_size)[perm] if static_groups else None
    scale = zero = None
    for start in range(0, inp, block_size):
        stop = min(start + block_size, inp)
        block = w[:, start:stop].copy()
        errors = np.zeros_like(block)
        for i in range(stop - start):
            col = start + i
            if static_groups:
                scale, zero = scales[:, group_of[col]], zeros[:, group_of[col]]
            elif col % group_size == 0:  # a new group: its range from the updated weights
                group = np.concatenate([block[:, i:], w[:, stop:]], axis=1)[:, :group_size]
                scale, zero = _params(group, bits, symmetric)
                scales[:, col // group_size], zeros[:, col // group_size] = scale, zero
            q = np.clip(np.rint(block[:, i] / scale) + zero, qmin, qmax)
            codes[:, col] = q
            deq[:, col] = (q - zero) * scale
            err = (block[:, i] - deq[:, col]) / hinv[col, col]
            block[:, i:] -= np.outer(err, hinv[col, col:stop])
            errors[:, i] = err
        w[:, stop:] -= errors @ hinv[start:stop, stop:]
    inverse = np.argsort(perm)
    group_ids = np.arange(inp) // group_size
    g_idx = group_ids if static_groups else group_ids[inverse]
    return GPTQResult(deq[:, inverse].astype(np.float32), codes[:, inverse], scales, zeros,
                      g_idx)


def _params(group: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point of each row of ``group`` ``[out, group_size]``."""
    return quant_params(group.min(axis=1), group.max(axis=1), bits, symmetric)
