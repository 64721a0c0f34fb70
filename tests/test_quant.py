"""Quantization from scratch: exact packing, hand-checked grids, and the methods' claims."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from labkit.checks import ParameterError
from labkit.quant import (awq_quantize, fp8_max, gptq_quantize, output_error, pack_int4,
                          quantize, quantize_fp8, smooth_scales, unpack_int4, w8a8_output)

rng = np.random.default_rng(0)


@given(arrays(np.int8, st.tuples(st.integers(1, 4), st.integers(1, 16).map(lambda n: 2 * n)),
              elements=st.integers(-8, 7)))
def test_int4_packing_round_trips_signed(codes):
    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and packed.shape[-1] == codes.shape[-1] // 2
    np.testing.assert_array_equal(unpack_int4(packed, signed=True), codes)


@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 16).map(lambda n: 2 * n)),
              elements=st.integers(0, 15)))
def test_int4_packing_round_trips_unsigned(codes):
    np.testing.assert_array_equal(unpack_int4(pack_int4(codes), signed=False), codes)


def test_symmetric_int8_by_hand():
    # max |w| = 2.54 -> scale 0.02; 1.0 -> round(50) = 50 exactly; -2.54 -> -127.
    w = np.array([[1.0, -2.54, 0.011]], np.float32)
    qt = quantize(w, bits=8, symmetric=True, granularity="channel")
    assert qt.scale[0, 0] == pytest.approx(0.02)
    np.testing.assert_array_equal(qt.q, [[50, -127, 1]])


def test_asymmetric_int4_by_hand():
    # range [-1, 2] over 15 steps: scale 0.2, zero point round(1 / 0.2) = 5;
    # 0.66 / 0.2 = 3.3 rounds to 3, code 3 + 5 = 8, back to (8 - 5) * 0.2 = 0.6.
    w = np.array([[-1.0, 2.0, 0.66, 0.0]], np.float32)
    qt = quantize(w, bits=4, symmetric=False, granularity="channel")
    assert (qt.scale[0, 0], qt.zero[0, 0]) == (pytest.approx(0.2), 5)
    np.testing.assert_array_equal(qt.q, [[0, 15, 8, 5]])
    np.testing.assert_allclose(qt.dequantize(), [[-1.0, 2.0, 0.6, 0.0]], atol=1e-6)


def test_one_signed_group_keeps_zero_representable_by_hand():
    # All positive: the range widens to [0, 3], not [0.6, 3]: scale 0.2, zero point 0.
    w = np.array([[0.6, 1.0, 2.0, 3.0]], np.float32)
    for sign, zero, codes in ((1, 0, [3, 5, 10, 15]), (-1, 15, [12, 10, 5, 0])):
        qt = quantize(sign * w, bits=4, symmetric=False, granularity="channel")
        assert (qt.scale[0, 0], qt.zero[0, 0]) == (pytest.approx(0.2), zero)
        np.testing.assert_array_equal(qt.q, [codes])
        np.testing.assert_allclose(qt.dequantize(), sign * w, atol=1e-6)


def test_memory_accounting_includes_scales():
    w = rng.normal(size=(256, 1024)).astype(np.float32)
    grouped = quantize(w, 4, False, "group", 128)
    # 4 bits per weight + per group (8 groups per row): fp16 scale + 4-bit zero.
    assert grouped.num_bytes == 256 * 1024 // 2 + 256 * 8 * 2 + 256 * 8 // 2
    assert quantize(w, 8, True, "tensor").num_bytes == 256 * 1024 + 2


def test_finer_groups_cost_bytes_and_buy_accuracy():
    w = rng.standard_t(df=3, size=(64, 512)).astype(np.float32)
    errors = [np.abs(quantize(w, 4, True, g, 128).dequantize() - w).mean()
              for g in ("tensor", "channel", "group")]
    assert errors[0] > errors[1] > errors[2]


def outlier_layer():
    x = rng.normal(size=(512, 256)).astype(np.float32)
    x[:, :4] *= 30  # a few input channels with large activations, as in real LLMs
    w = (rng.normal(size=(128, 256)) * 0.05).astype(np.float32)
    return w, x


def test_awq_beats_round_to_nearest_on_outlier_channels():
    w, x = outlier_layer()
    rtn = quantize(w, 4, False, "group", 128).dequantize()
    awq = awq_quantize(w, x, bits=4, group_size=128)
    assert output_error(x, w, awq.dequantize()) < 0.5 * output_error(x, w, rtn)
    assert awq.ratio > 0  # the search chose to protect the salient channels


def test_awq_scaling_is_exact_before_rounding():
    w, x = outlier_layer()
    s = awq_quantize(w, x, bits=4, group_size=128, search_clip=False).scales
    np.testing.assert_allclose((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)


def correlated_layer():
    x = rng.normal(size=(512, 32)) @ rng.normal(size=(32, 256)) + 0.1 * rng.normal(size=(512, 256))
    w = (rng.normal(size=(128, 256)) * 0.05).astype(np.float32)
    return w, x.astype(np.float32)


def test_gptq_beats_round_to_nearest_on_correlated_activations():
    w, x = correlated_layer()
    rtn = quantize(w, 4, False, "group", 128).dequantize()
    gptq = gptq_quantize(w, x, bits=4, group_size=128)
    assert output_error(x, w, gptq.weight) < 0.2 * output_error(x, w, rtn)
    ordered = gptq_quantize(w, x, bits=4, group_size=128, act_order=True)
    assert output_error(x, w, ordered.weight) < output_error(x, w, rtn)


def test_gptq_codes_and_groups_reconstruct_its_weights():
    w, x = correlated_layer()
    for act_order in (False, True):
        g = gptq_quantize(w, x, bits=4, group_size=64, act_order=act_order)
        rows = np.arange(w.shape[0])[:, None]
        rebuilt = (g.q - g.zeros[rows, g.g_idx[None, :]]) * g.scales[rows, g.g_idx[None, :]]
        np.testing.assert_allclose(rebuilt, g.weight, atol=1e-5)
        assert g.q.min() >= 0 and g.q.max() <= 15


def test_gptq_without_feedback_is_round_to_nearest():
    # With an identity-like Hessian there is nothing to feed back: GPTQ equals RTN.
    w = rng.normal(size=(16, 128)).astype(np.float32)
    x = np.eye(128, dtype=np.float32) * np.sqrt(128)
    g = gptq_quantize(w, x, bits=4, group_size=128, damp=1e-6)
    rtn = quantize(w, 4, False, "group", 128).dequantize()
    np.testing.assert_allclose(g.weight, rtn, atol=1e-4)


def test_fp8_saturates_where_a_plain_cast_overflows():
    assert np.isnan(np.array([1000.0], np.float32).astype(ml_dtypes.float8_e4m3fn)[0])
    assert fp8_max("e4m3") == 448 and fp8_max("e5m2") == 57344
    big = np.array([[1000.0, 1.0, -3000.0]], np.float32)
    for scheme in ("tensor", "channel", "token"):
        out = quantize_fp8(big, "e4m3", scheme).dequantize()
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, big, rtol=0.07)  # 3 mantissa bits: ~6 % steps


def test_per_token_fp8_protects_small_rows():
    x = np.vstack([rng.normal(size=64) * 1000, rng.normal(size=64) * 1e-3]).astype(np.float32)
    tensor = quantize_fp8(x, scheme="tensor").dequantize()
    token = quantize_fp8(x, scheme="token").dequantize()
    small_err = lambda y: np.abs(y[1] - x[1]).mean() / np.abs(x[1]).mean()  # noqa: E731
    assert small_err(token) < 0.1 < small_err(tensor)


def test_smoothquant_rescues_w8a8_with_outliers():
    w, x = outlier_layer()
    x[:, :4] *= 10  # SmoothQuant's regime: outliers near 100x
    exact = x @ w.T
    plain = np.mean((w8a8_output(x, w) - exact) ** 2)
    smooth = np.mean((w8a8_output(x, w, smooth_scales(x, w, 0.5)) - exact) ** 2)
    assert smooth < plain / 5


@pytest.mark.parametrize("call, match", [
    (lambda: quantize(np.ones((2, 6)), 4, True, "group", 4), "group_size .4. must divide"),
    (lambda: quantize(np.ones((2, 8)), 5), "bits must be"),
    (lambda: quantize(np.ones(8)), "w must be a matrix"),
    (lambda: quantize(np.ones((2, 8)), granularity="row"), "granularity must be"),
    (lambda: pack_int4(np.ones((1, 3))), "must be even"),
    (lambda: quantize_fp8(np.ones(3), "e3m4"), "fmt must be one of"),
    (lambda: gptq_quantize(np.ones((2, 8)), np.ones((4, 6)), group_size=4),
     r"x must be \[tokens, 8\]"),
    (lambda: smooth_scales(np.ones((2, 2)), np.ones((2, 2)), 1.5), "alpha must be in"),
])
def test_bad_input(call, match):
    with pytest.raises(ParameterError, match=match) as err:
        call()
    assert err.value.param and str(err.value).startswith(err.value.param)
