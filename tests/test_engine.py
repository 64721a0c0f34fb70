"""The teaching engine: equal to transformers, vLLM's offline API, sampling and stops."""

import numpy as np
import pytest

from labkit.engine import LLM, LLMEngine, EngineArgs, SamplingParams, write_tiny_model
from labkit.engine.sampling import sample
from labkit.engine.weights import load_safetensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def collect_logits(engine, prompt_ids):
    """Run one request to its first token, gathering every prompt position's logits."""
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=1, temperature=0))
    rows = []
    while engine.has_unfinished_requests():
        engine.step()
        rows.append(engine.last_step_logits[rid])
    return np.concatenate(rows)


def test_logits_equal_transformers_with_paging_chunking_and_prefix_cache(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 512, size=45).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].numpy()

    # block_size 4 and a budget of 8 tokens: paged attention over many blocks, and a
    # prompt prefilled in six chunks.
    engine = LLMEngine(EngineArgs(tiny, block_size=4, max_num_batched_tokens=8))
    np.testing.assert_allclose(collect_logits(engine, prompt), expected, atol=1e-4)

    # The same prompt again: 44 tokens come from the prefix cache, the last is recomputed.
    again = collect_logits(engine, prompt)
    assert engine.kv_cache.prefix_cache_hits >= 44
    np.testing.assert_allclose(again, expected[-1:], atol=1e-4)


def test_greedy_generation_matches_transformers_generate(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        ids = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = LLM(tiny).generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ids


def test_batched_outputs_do_not_depend_on_the_batch(tiny):
    llm = LLM(tiny, max_num_batched_tokens=16, block_size=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    alone = llm.generate("The key value cache", params)[0].outputs[0].token_ids
    batch = llm.generate(["Tensor parallelism", "The key value cache", "Hello"], params)
    assert batch[1].outputs[0].token_ids == alone
    assert llm.llm_engine.kv_cache.block_pool.num_free_blocks == llm.llm_engine.num_gpu_blocks


def test_stop_strings_and_tokens(tiny):
    llm = LLM(tiny)
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    text, ids = free[0].outputs[0].text, free[0].outputs[0].token_ids
    stop = text[3:5]
    cut = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, stop=[stop],
                                               ignore_eos=True))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[:3]
    by_id = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10,
                                                 stop_token_ids=[ids[2]],
                                                 ignore_eos=True))[0].outputs[0]
    assert by_id.token_ids == ids[:3] and by_id.stop_reason == ids[2]


def test_sampler():
    logits = np.array([0.0, 5.0, 4.0, -1.0])
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(temperature=0), rng) == 1
    picks = {sample(logits, SamplingParams(top_k=2), rng) for _ in range(200)}
    assert picks == {1, 2}
    picks = {sample(logits, SamplingParams(top_p=0.5), rng) for _ in range(200)}
    assert picks == {1}                       # token 1 alone holds over half the mass


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_k": -5}, "top_k must be -1"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests(tiny, tmp_path):
    engine = LLM(tiny, max_model_len=64).llm_engine
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([10**6])
    with pytest.raises(ValueError, match="not a model directory"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="only .* fit"):
        LLM(tiny, device_memory_gib=0.002)


def test_abort_frees_blocks(tiny):
    engine = LLM(tiny).llm_engine
    rid = engine.add_request("Hello world", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache.block_pool.num_free_blocks < engine.num_gpu_blocks
    engine.abort_request(rid)
    assert engine.kv_cache.block_pool.num_free_blocks == engine.num_gpu_blocks
    assert not engine.has_unfinished_requests()


def test_bf16_checkpoints_load(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    t = torch.randn(3, 4).to(torch.bfloat16)
    safetensors_torch.save_file({"w": t}, str(tmp_path / "x.safetensors"))
    np.testing.assert_array_equal(load_safetensors(tmp_path / "x.safetensors")["w"],
                                  t.float().numpy())


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"The answer is [A-D]\."])
def test_regex_constrained_output_matches(tiny, pattern):
    import regex

    llm = LLM(tiny)
    for seed in range(3):
        out = llm.generate("Hello", SamplingParams(temperature=1.0, seed=seed, max_tokens=30,
                                                   regex=pattern))[0].outputs[0]
        assert regex.fullmatch(pattern, out.text) and out.finish_reason == "stop"


def test_invalid_regex_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="regex: invalid pattern"):
        LLM(tiny).generate("x", SamplingParams(regex="(unclosed"))


def test_qwen2_checkpoint_matches_transformers(tiny, tmp_path):
    """Qwen2 adds q/k/v biases; a transformers-written checkpoint loads and agrees."""
    import shutil

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=512, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random, visible biases
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", tmp_path / name)
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    engine = LLMEngine(EngineArgs(str(tmp_path), block_size=8, max_num_batched_tokens=16))
    np.testing.assert_allclose(collect_logits(engine, prompt), expected, atol=1e-4)
