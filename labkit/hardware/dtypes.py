"""Number formats for weights and for the KV cache, and what each costs in bytes
(:ref:`ch01-what-fits`).

Weights and KV cache are sized separately on purpose: an INT4 AWQ model still keeps its KV
cache in BF16 unless the engine is told otherwise (vLLM's ``kv_cache_dtype``), so sizing the
cache with the weights' precision (as the seed tutorial does) under-counts it by 4x.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError


@dataclass(frozen=True)
class WeightFormat:
    """How the weights of a checkpoint are stored.

    ``bits`` is the storage width of one quantized weight. Group-wise formats (AWQ, GPTQ) add
    ``group_overhead_bits`` per ``group_size`` weights: a 16-bit scale and a packed 4-bit zero
    point. Quantized formats touch only the linear layers of the decoder blocks; embeddings,
    the LM head and norms stay in 16-bit, which is how AWQ, GPTQ and llm-compressor ship them.
    ``compute_dtype`` is the tensor-core input type of the matmuls (W4A16 computes in BF16).
    """

    name: str
    bits: int
    quantized: bool
    compute_dtype: str
    group_size: int | None = None
    group_overhead_bits: int = 0

    @property
    def bits_per_weight(self) -> float:
        """Average storage bits per quantized weight, group scales included."""
        if self.group_size is None:
            return float(self.bits)
        return self.bits + self.group_overhead_bits / self.group_size


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in [
        WeightFormat("fp32", 32, quantized=False, compute_dtype="fp32"),
        WeightFormat("bf16", 16, quantized=False, compute_dtype="bf16"),
        WeightFormat("fp16", 16, quantized=False, compute_dtype="fp16"),
        # W8A8: per-channel scales, negligible next to the weights.
        WeightFormat("fp8", 8, quantized=True, compute_dtype="fp8"),
        WeightFormat("int8", 8, quantized=True, compute_dtype="int8"),
        # Weight-only INT4 with one scale per output channel (W4A16).
        WeightFormat("int4", 4, quantized=True, compute_dtype="bf16"),
        # AWQ / GPTQ, group size 128: fp16 scale + packed int4 zero point per group.
        WeightFormat("int4-awq", 4, quantized=True, compute_dtype="bf16",
                     group_size=128, group_overhead_bits=16 + 4),
        WeightFormat("int4-gptq", 4, quantized=True, compute_dtype="bf16",
                     group_size=128, group_overhead_bits=16 + 4),
    ]
}

#: Bytes per element of the KV cache. ``fp8`` covers vLLM's ``fp8_e4m3`` and ``fp8_e5m2``.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_KV_ALIASES = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float16": "fp16", "bfloat16": "bf16",
               "float32": "fp32"}


def weight_format(name: str | WeightFormat) -> WeightFormat:
    """Look up a weight format by name (``bf16``, ``fp8``, ``int8``, ``int4-awq``, ...)."""
    if isinstance(name, WeightFormat):
        return name
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ParameterError(
            "weight_dtype", f"weight_dtype must be one of {sorted(WEIGHT_FORMATS)}, got {name!r}"
        ) from None


def kv_dtype_bytes(name: str) -> int:
    """Bytes per KV-cache element for a dtype name; accepts vLLM's ``fp8_e4m3``/``fp8_e5m2``."""
    key = _KV_ALIASES.get(name, name)
    if key not in KV_DTYPE_BYTES:
        allowed = sorted(set(KV_DTYPE_BYTES) | set(_KV_ALIASES))
        raise ParameterError("kv_dtype", f"kv_dtype must be one of {allowed}, got {name!r}")
    return KV_DTYPE_BYTES[key]


def default_kv_dtype(weight_dtype: str | WeightFormat) -> str:
    """What vLLM's ``kv_cache_dtype="auto"`` picks: the activation dtype, not the weights'."""
    return "fp32" if weight_format(weight_dtype).name == "fp32" else "bf16"
