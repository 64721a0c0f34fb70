"""Checks for the exercises of the chapter 4 labs (quantization)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from labkit.grading import Feedback, check_number
from labkit.quant import fp8_max, quantize


def check_rtn(fn: Callable | None, seed: int = 0) -> Feedback:
    """Lab 04a, exercise 1: ``fn(w, bits)`` -> symmetric per-output-channel RTN, dequantized."""
    if fn is None:
        return Feedback(False, "Not answered yet: write my_quantize(w, bits).")
    rng = np.random.default_rng(seed)
    w = rng.standard_t(df=4, size=(16, 64)).astype(np.float32)
    for bits in (8, 4):
        got = np.asarray(fn(w.copy(), bits), dtype=np.float32)
        expected = quantize(w, bits, True, "channel").dequantize()
        if got.shape != w.shape:
            return Feedback(False, f"Not quite: the result has shape {got.shape}, expected "
                                   f"{w.shape} (return the dequantized weights).")
        if np.allclose(got, expected, atol=1e-6):
            continue
        qmax = 2 ** (bits - 1) - 1
        amax = np.abs(w).max(axis=1, keepdims=True)
        wrong_range = np.rint(w / (amax / (2 ** bits - 1))) * (amax / (2 ** bits - 1))
        per_tensor = quantize(w, bits, True, "tensor").dequantize()
        truncated = np.trunc(w / (amax / qmax)) * (amax / qmax)
        if np.allclose(got, per_tensor, atol=1e-6):
            return Feedback(False, f"Not quite ({bits} bits): one scale for the whole tensor; "
                                   f"use one per output channel (row).")
        if np.allclose(got, truncated, atol=1e-6):
            return Feedback(False, f"Not quite ({bits} bits): round to nearest, don't truncate.")
        if np.allclose(got, wrong_range, atol=1e-6):
            return Feedback(False, f"Not quite ({bits} bits): symmetric codes span "
                                   f"[-{qmax}, {qmax}], not {2 ** bits - 1} steps each way.")
        return Feedback(False, f"Not quite ({bits} bits): max error "
                               f"{np.abs(got - expected).max():.3g} against labkit's RTN.")
    return Feedback(True, "Correct: per-channel symmetric round-to-nearest, 8 and 4 bits.")


def check_int4_group_bytes(answer: object, rows: int = 4096, cols: int = 4096,
                           group_size: int = 128) -> Feedback:
    """Lab 04a, exercise 2: bytes of an asymmetric INT4 matrix with per-group fp16 scales and
    4-bit zero points."""
    groups = rows * cols // group_size
    expected = rows * cols / 2 + groups * 2 + groups / 2
    return check_number(answer, expected, what="INT4 bytes", unit="bytes", rel_tol=1e-9,
                        mistakes={"left out the scales and zero points": rows * cols / 2,
                                  "stored zero points as full bytes": expected + groups / 2,
                                  "stored one byte per weight": rows * cols + groups * 2.5})


def check_fp8_scale(answer: object, amax: float = 1000.0, fmt: str = "e4m3") -> Feedback:
    """Lab 04a, exercise 3: the per-tensor scale that maps ``amax`` to FP8's largest value."""
    top = fp8_max(fmt)
    return check_number(answer, amax / top, what="FP8 scale", rel_tol=1e-6,
                        mistakes={"inverted it (largest FP8 value / amax)": top / amax,
                                  "used E5M2's range": amax / fp8_max("e5m2"),
                                  "used 127 as for INT8": amax / 127})
