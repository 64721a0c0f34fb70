"""Our GPTQ against llm-compressor's, on the same weights, Hessian and quantization grid."""

import numpy as np
import pytest

from labkit.quant import gptq_quantize, output_error, quant_params, quantize

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight  # noqa: E402

pytestmark = pytest.mark.real_engine  # llm-compressor

GROUP = 128


def llmcompressor_gptq(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llm-compressor 0.14's GPTQ (W4A16 asymmetric, group 128), scales from its min/max."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=GROUP)
    weight = torch.tensor(w, dtype=torch.float32)
    groups = weight.reshape(w.shape[0], -1, GROUP)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    xt = torch.tensor(x, dtype=torch.float32)
    hessian = 2 * xt.T @ xt / len(x)  # the same normalisation llm-compressor accumulates
    out, *_ = quantize_weight(weight[None], hessian[None], scale[None], zero[None], None, args,
                              blocksize=128, percdamp=0.01)
    return out[0].numpy()


def test_our_gptq_agrees_with_llmcompressor():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(512, 32)) @ rng.normal(size=(32, 256))
         + 0.1 * rng.normal(size=(512, 256))).astype(np.float32)
    w = (rng.normal(size=(64, 256)) * 0.05).astype(np.float32)
    theirs = llmcompressor_gptq(w, x)
    ours = gptq_quantize(w, x, bits=4, group_size=GROUP, damp=0.01, static_groups=True).weight
    # Both compute in float32/float64 and round the same grid: nearly every weight lands on
    # the same level, and none is more than one level away.
    groups = w.reshape(64, -1, GROUP)
    step = ((np.maximum(groups.max(-1), 0) - np.minimum(groups.min(-1), 0)) / 15)
    step = step.repeat(GROUP, axis=1)  # one quantization level, per weight
    same = np.isclose(ours, theirs, atol=1e-3 * step.min())
    assert same.mean() > 0.99
    assert np.all(np.abs(ours - theirs) <= 1.01 * step)
    rtn = quantize(w, 4, False, "group", GROUP).dequantize()
    assert output_error(x, w, ours) == pytest.approx(output_error(x, w, theirs), rel=0.02)
    assert output_error(x, w, ours) < 0.2 * output_error(x, w, rtn)


@pytest.mark.parametrize("sign", [1, -1], ids=["all positive", "all negative"])
def test_one_signed_groups_get_compressed_tensors_qparams(sign):
    # Groups of one sign: like compressed-tensors, the range includes 0 so that 0 is a code.
    rng = np.random.default_rng(1)
    w = (sign * rng.uniform(0.5, 2.0, size=(8, 2 * GROUP))).astype(np.float32)
    groups = w.reshape(8, -1, GROUP)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=GROUP)
    t = torch.tensor(groups)
    their_scale, their_zero = calculate_qparams(t.amin(-1), t.amax(-1), args)
    scale, zero = quant_params(groups.min(-1), groups.max(-1), bits=4, symmetric=False)
    np.testing.assert_allclose(scale, their_scale.numpy(), rtol=1e-6)
    # compressed-tensors stores signed codes, -8..7: its zero point is ours minus 8.
    np.testing.assert_array_equal(zero, their_zero.numpy().astype(np.float32) + 8)
    # RTN and GPTQ share the rule; with nothing to feed back (identity Hessian) they agree.
    rtn = quantize(w, 4, False, "group", GROUP)
    x = np.eye(2 * GROUP, dtype=np.float32) * np.sqrt(2 * GROUP)
    gptq = gptq_quantize(w, x, bits=4, group_size=GROUP, damp=1e-6)
    np.testing.assert_allclose(gptq.scales, rtn.scale, rtol=1e-6)
    np.testing.assert_array_equal(gptq.zeros, rtn.zero)
    np.testing.assert_allclose(gptq.weight, rtn.dequantize(), atol=1e-5)
    assert np.abs(rtn.dequantize() - w).max() <= 0.5001 * scale.max()  # no value saturates
