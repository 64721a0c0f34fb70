"""Chapter 4 exercise checks."""

import numpy as np

from labkit.exercises import ch04 as ex
from labkit.quant import quantize


def test_rtn_exercise_names_the_usual_mistakes():
    def right(w, bits):
        return quantize(w, bits, True, "channel").dequantize()

    def per_tensor(w, bits):
        return quantize(w, bits, True, "tensor").dequantize()

    def truncating(w, bits):
        qmax = 2 ** (bits - 1) - 1
        scale = np.abs(w).max(axis=1, keepdims=True) / qmax
        return np.trunc(w / scale) * scale

    assert ex.check_rtn(right)
    assert "one scale for the whole tensor" in repr(ex.check_rtn(per_tensor))
    assert "don't truncate" in repr(ex.check_rtn(truncating))
    assert "shape" in repr(ex.check_rtn(lambda w, bits: w[0]))
    assert not ex.check_rtn(None)


def test_int4_bytes_and_fp8_scale():
    # 4096 * 4096 / 2 bytes of codes + 131072 groups x (2 bytes scale + half a byte zero).
    assert ex.check_int4_group_bytes(4096 * 4096 / 2 + 131072 * 2.5)
    assert "scales and zero points" in repr(ex.check_int4_group_bytes(4096 * 4096 / 2))
    assert ex.check_fp8_scale(1000 / 448)
    assert "inverted" in repr(ex.check_fp8_scale(448 / 1000))
