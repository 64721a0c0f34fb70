"""benchmarks/gpu_check.py, the run a session with a GPU starts at once, checked without one.

Its decode step must touch exactly the bytes chapter 1's roofline counts, or "of roofline"
would compare two different workloads; it must be a real decode step (the logits of a
Llama written by transformers, given the same weights and cache); and a dry run on the CPU
must go through every part that does not need CUDA.
"""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from labkit.hardware import get_model  # noqa: E402
from labkit.hardware.roofline import decode_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" /
                                                  "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


TIED = dataclasses.replace(gpu_check.TINY, name="tied", tie_word_embeddings=True)


@pytest.mark.parametrize("model", ["Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B", TIED],
                         ids=str)
@pytest.mark.parametrize("batch_size, context_len", [(1, 1), (8, 1024), (64, 4096)])
def test_the_step_touches_the_bytes_the_roofline_counts(model, batch_size, context_len):
    spec = get_model(model)  # Qwen2.5: q/k/v biases; TIED reads its embedding as the LM head
    step = gpu_check.DecodeStep(spec, batch_size, context_len, device="meta")
    bound = decode_step(spec, "H200 SXM", batch_size, context_len)
    assert step.bytes_touched() == bound.bytes_moved


def test_mixture_of_experts_is_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        gpu_check.DecodeStep(get_model("Mixtral-8x7B"), 1, 16, device="meta")


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA A10G", "A10G"), ("NVIDIA B200", "B200")])
def test_device_names_find_their_datasheet_row(name, row):
    assert gpu_check.gpu_row(name) == row


def test_an_unknown_device_asks_for_its_row():
    with pytest.raises(ValueError, match="pass --gpu"):
        gpu_check.gpu_row("NVIDIA B300 SXM6 AC")


def test_the_step_is_a_llama_decode_step():
    """Our step's logits equal transformers' LlamaForCausalLM fed the same weights, the same
    cached K/V (given to it as a cache) and the same new token, in float32."""
    transformers = pytest.importorskip("transformers")
    spec = gpu_check.TINY
    batch, context = 2, 5
    step = gpu_check.DecodeStep(spec, batch, context, device="cpu", dtype=torch.float32)
    step.tokens[:] = torch.tensor([3, 7])
    config = transformers.LlamaConfig(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        vocab_size=spec.vocab_size, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    q, kv = spec.q_size, spec.kv_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(step.embedding)
        model.lm_head.weight.copy_(step.lm_head.T)
        model.model.norm.weight.copy_(step.final_norm)
        for ours, theirs in zip(step.layers, model.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            theirs.input_layernorm.weight.copy_(ours["input_norm"])
            theirs.post_attention_layernorm.weight.copy_(ours["post_norm"])
            attn.q_proj.weight.copy_(ours["qkv"][:, :q].T)
            attn.k_proj.weight.copy_(ours["qkv"][:, q:q + kv].T)
            attn.v_proj.weight.copy_(ours["qkv"][:, q + kv:].T)
            attn.o_proj.weight.copy_(ours["o"].T)
            gate, up = ours["gate_up"].chunk(2, dim=1)
            mlp.gate_proj.weight.copy_(gate.T)
            mlp.up_proj.weight.copy_(up.T)
            mlp.down_proj.weight.copy_(ours["down"].T)
        cache = transformers.DynamicCache(config=config)
        for i, layer in enumerate(step.layers):  # the context before the new token
            cache.update(layer["k"][:, :, :context - 1].clone(),
                         layer["v"][:, :, :context - 1].clone(), i)
        # Our step applies no rotary embedding (a few FLOPs a token, no bytes): position 0
        # is transformers' rotation by zero. The cache still holds context - 1 tokens.
        theirs = model(input_ids=step.tokens[:, None], past_key_values=cache,
                       position_ids=torch.zeros(batch, 1, dtype=torch.long)).logits[:, -1]
        ours = step()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_dry_run_on_the_cpu_reports_every_part(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--device", "cpu", "--model", "tiny", "--batch-sizes", "1,2",
                           "--context-len", "16"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["batch_size"] for r in report["decode"]] == [1, 2]
    assert all(r["bytes_touched"] == r["roofline_bytes"] for r in report["decode"])
    assert all(r["graph_ms"] is None and r["eager_ms"] > 0 for r in report["decode"])
    engines = {r["engine"] for r in report["labs"]}
    assert engines == {"vllm", "sglang", "tensorrt_llm"}
    # This venv has none of the engines (vLLM's CPU build lives in .venv-vllm): named, not run.
    assert all(r["outcome"].startswith("not run") for r in report["labs"])
    assert "3. one decode step of tiny" in capsys.readouterr().out


def test_cuda_is_asked_for_by_default(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the default run is the real one")
    assert gpu_check.main([]) == 2
    assert "--device cpu" in capsys.readouterr().err
