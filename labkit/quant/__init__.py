"""Quantization from scratch, in NumPy (:doc:`chapter 4 </chapters/ch04_quantization>`).

- :func:`quantize` (round-to-nearest; INT8/INT4, symmetric or not, per tensor, channel or
  group) with :func:`quant_params`, the scales and zero points GPTQ shares, and
  :func:`pack_int4` / :func:`unpack_int4`.
- :func:`awq_quantize`: activation-aware scales and clipping.
- :func:`gptq_quantize`: second-order error feedback, groups, activation order
  (:ref:`ch04-gptq`).
- :func:`quantize_fp8`: E4M3 / E5M2 with per-tensor, per-channel and per-token scales.
- :func:`smooth_scales`, :func:`w8a8_output`: SmoothQuant for W8A8.
- :mod:`labkit.quant.model`: quantize a checkpoint's linear layers; perplexity and logit error.
"""

from labkit.quant.awq import (AWQResult, awq_quantize, output_error, ratio_errors,
                              search_clip_ratios, search_scales)
from labkit.quant.fp8 import FP8Tensor, fp8_max, quantize_fp8
from labkit.quant.gptq import GPTQResult, gptq_quantize
from labkit.quant.rtn import QuantizedTensor, pack_int4, quant_params, quantize, unpack_int4
from labkit.quant.smoothquant import smooth_scales, w8a8_output

__all__ = ["AWQResult", "FP8Tensor", "GPTQResult", "QuantizedTensor", "awq_quantize",
           "fp8_max", "gptq_quantize", "output_error", "pack_int4", "quant_params", "quantize",
           "quantize_fp8", "ratio_errors", "search_clip_ratios", "search_scales",
           "smooth_scales", "unpack_int4", "w8a8_output"]
