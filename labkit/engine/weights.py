"""Read ``*.safetensors`` checkpoints into float32 NumPy arrays, BF16 included
(:doc:`chapter 2 </chapters/ch02_engines>`).

NumPy has no bfloat16, so BF16 tensors are widened by hand: a BF16 number is the upper 16 bits
of the float32 with the same value. The format itself is simple: an 8-byte little-endian
header length, a JSON header giving each tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from labkit.checks import ParameterError

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I8": np.int8, "U8": np.uint8,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file; floating point ones as float32."""
    data = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = body[start:end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _DTYPES:
            array = np.frombuffer(raw, _DTYPES[info["dtype"]])
        else:
            raise ParameterError("path", f"path: tensor {name!r} of {Path(path).name} has "
                                         f"unsupported dtype {info['dtype']} (BF16 or one "
                                         f"of {', '.join(_DTYPES)})")
        array = array.reshape(info["shape"])
        tensors[name] = array.copy() if array.dtype.kind in "iu" else array.astype(np.float32)
    return tensors


def load_checkpoint(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a model directory, one or several ``.safetensors`` shards.

    Quantized checkpoints (llm-compressor's compressed-tensors formats, AutoAWQ's GEMM format)
    are dequantized on load (chapter 4): the engine computes with the quantized values.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ParameterError("model_dir", f"model_dir: no .safetensors file in {model_dir}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_safetensors(file))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant:
        from labkit.engine.dequant import dequantize

        tensors = dequantize(tensors, quant)
    return tensors
