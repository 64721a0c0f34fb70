"""Whole-checkpoint quantization: loadable by the engine, errors ordered by precision."""

import json

import numpy as np
import pytest

from labkit.engine import LLM, SamplingParams, write_tiny_model
from labkit.quant.model import (METHODS, calibrate, logit_error, perplexity,
                                quantize_checkpoint)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


SEQS = [list(np.random.default_rng(i).integers(0, 512, size=64)) for i in range(3)]


def test_calibration_sees_every_linear_layer(tiny):
    inputs = calibrate(tiny, SEQS[:2])
    assert len(inputs) == 2 * 7                       # 2 layers x (q, k, v, o, gate, up, down)
    assert inputs["model.layers.0.self_attn.q_proj"].shape == (128, 128)
    assert inputs["model.layers.1.mlp.down_proj"].shape == (128, 256)


@pytest.mark.parametrize("method", METHODS)
def test_quantized_checkpoints_load_and_run(tiny, tmp_path, method):
    out = quantize_checkpoint(tiny, tmp_path / method, method, calibration=SEQS[:2])
    assert json.loads((out / "config.json").read_text())["labkit_fake_quantization"] == method
    text = LLM(str(out)).generate("Hello", SamplingParams(max_tokens=4))[0].outputs[0]
    assert len(text.token_ids) >= 1
    assert np.isfinite(perplexity(out, SEQS[2:]))


def test_fewer_bits_move_the_logits_more(tiny, tmp_path):
    errors = {m: logit_error(tiny, quantize_checkpoint(tiny, tmp_path / m, m, SEQS[:2]), SEQS[2:])
              for m in ("rtn-int8", "fp8", "rtn-int4")}
    assert errors["rtn-int8"] < errors["fp8"] < errors["rtn-int4"]
    assert logit_error(tiny, tiny, SEQS[2:]) == 0.0


def test_bad_requests(tiny, tmp_path):
    with pytest.raises(ValueError, match="method must be one of"):
        quantize_checkpoint(tiny, tmp_path / "x", "int3")
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_checkpoint(tiny, tmp_path / "x", "gptq-int4")


def test_awq_scaling_folds_exactly_into_the_model(tiny, tmp_path):
    """Before rounding, AWQ's scales change nothing: the folded model computes the same."""
    import shutil

    from safetensors.numpy import save_file

    from labkit.engine.weights import load_checkpoint
    from labkit.quant.model import apply_awq_scales

    weights = load_checkpoint(tiny)
    before = weights["model.layers.0.input_layernorm.weight"].copy()
    apply_awq_scales(weights, calibrate(tiny, SEQS[:2]))
    assert not np.allclose(weights["model.layers.0.input_layernorm.weight"], before)
    folded = tmp_path / "folded"
    shutil.copytree(tiny, folded)
    save_file(weights, str(folded / "model.safetensors"))
    assert logit_error(tiny, folded, SEQS[2:]) < 1e-5
