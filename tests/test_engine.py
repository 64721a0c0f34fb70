"""The teaching engine: equal to transformers, vLLM's offline API, sampling and stops."""

import numpy as np
import pytest

from labkit.engine import (
    LLM,
    EngineArgs,
    LLMEngine,
    RequestOutputKind,
    SamplingParams,
    write_tiny_model,
)
from labkit.engine.sampling import sample
from labkit.engine.weights import load_safetensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def collect_logits(engine, prompt_ids):
    """Run one request to its first token, gathering every prompt position's logits."""
    engine.keep_all_logits = True
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
    ({"temperature": -1}, r"temperature must be in \[0, inf\)"),
    ({"temperature": float("nan")}, "temperature must be in"),
    ({"seed": 2**64}, "seed must be an integer"),
    ({"n": 0}, "n must be a positive integer"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be at most max_tokens"),
    ({"logprobs": 21}, "logprobs must be at most 20"),
    ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_k": -5}, "top_k must be -1"),
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests(tiny, tmp_path):
    engine = LLM(tiny, max_model_len=64).llm_engine
    with pytest.raises(ValueError, match="maximum context length is 64 tokens") as err:
        engine.add_request([1] * 65, SamplingParams(max_tokens=10))
    assert err.value.param == "input_tokens"
    with pytest.raises(ValueError, match="cannot be greater than max_model_len=64"):
        engine.add_request([1] * 4, SamplingParams(max_tokens=65))
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        engine.add_request([1] * 64, SamplingParams(max_tokens=10))
    # As vLLM 0.32: the completion gets what the context window leaves.
    rid = engine.add_request([1] * 60, SamplingParams(max_tokens=10, ignore_eos=True))
    assert engine.groups[rid][0].max_tokens == 4
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


def test_n_choices_fork_the_prompt_blocks_and_equal_greedy(tiny):
    """n > 1: the prompt is prefilled once and its full blocks are shared (reference counts
    of n), the partly filled last block is copied, and with top_k=1 (greedy; vLLM refuses
    n > 1 at temperature 0) every choice is the greedy completion."""
    engine = LLMEngine(EngineArgs(tiny, block_size=4))
    prompt = list(range(3, 13))  # 10 tokens: two full blocks and a partial one
    greedy = LLM(tiny, block_size=4).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    engine.add_request(prompt, SamplingParams(n=3, top_k=1, max_tokens=6, ignore_eos=True),
                       "r")
    engine.step()  # prefill of choice 0, then the fork
    kv = engine.kv_cache
    tables = [kv.get_block_ids(f"{i}_r") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert [kv.block_pool.blocks[b].ref_cnt for b in tables[0][:2]] == [3, 3]
    assert len({t[2] for t in tables}) == 3               # the partial block, copied
    assert kv.block_pool.num_free_blocks == kv.num_blocks - 5
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.token_ids == greedy.outputs[0].token_ids for c in final.outputs)
    assert kv.block_pool.num_free_blocks == kv.num_blocks and not engine.groups


def test_seeded_choices_differ_and_repeat(tiny):
    llm = LLM(tiny)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = [c.text for c in llm.generate("Hello", params)[0].outputs]
    again = [c.text for c in llm.generate("Hello", params)[0].outputs]
    assert first == again and len(set(first)) > 1
    # Choice i uses seed + i, as vLLM: choice 1 of seed 11 is choice 0 of seed 12.
    alone = llm.generate("Hello", SamplingParams(temperature=1.0, seed=12, max_tokens=8,
                                                 ignore_eos=True))[0].outputs[0].text
    assert alone == first[1]


def test_a_constraint_dead_end_fails_only_its_request(tiny):
    """A pattern the model's tokens cannot complete: that request ends with an error, the
    one beside it finishes normally, and no block is lost."""
    engine = LLMEngine(EngineArgs(tiny))
    bad = engine.add_request("Hello", SamplingParams(regex=r"a\u00e9{3}", max_tokens=8))
    good = engine.add_request("Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[bad].outputs[0].finish_reason == "error"
    assert finished[bad].error.param == "regex"
    assert finished[good].outputs[0].finish_reason == "length"
    assert engine.kv_cache.block_pool.num_free_blocks == engine.num_gpu_blocks


def test_prompt_logprobs_skip_the_prefix_cache(tiny):
    engine = LLMEngine(EngineArgs(tiny, block_size=4))
    prompt = list(range(3, 20))
    llm_params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    outputs = [LLM.__new__(LLM)]  # reuse the engine through the offline API
    outputs[0].llm_engine = engine
    first = outputs[0].generate([prompt], llm_params)[0]
    second = outputs[0].generate([prompt], llm_params)[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    assert second.num_cached_tokens == 0
    assert [next(iter(e)) for e in second.prompt_logprobs[1:]] == prompt[1:]
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True):
        assert a[next(iter(a))].logprob == pytest.approx(b[next(iter(b))].logprob, abs=1e-6)


def test_outputs_are_snapshots_the_engine_does_not_change_later(tiny):
    """A server's engine thread keeps stepping while the client's coroutine formats the last
    output: that output's logprobs must not grow past its tokens."""
    engine = LLMEngine(EngineArgs(tiny))
    engine.add_request("Hello", SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1,
                                               prompt_logprobs=1))
    first = engine.step()[0]
    engine.step()
    choice = first.outputs[0]
    assert len(choice.logprobs) == len(choice.token_ids) == 1
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids)


def test_a_catastrophically_backtracking_regex_fails_only_its_request(tiny, monkeypatch):
    """(a|aa){40,}c takes time exponential in the output to rule a character out: the mask
    gives up after MASK_TIMEOUT_S and the request ends with an error, the engine goes on."""
    from labkit.engine import constraints

    monkeypatch.setattr(constraints, "MASK_TIMEOUT_S", 0.5)
    engine = LLMEngine(EngineArgs(tiny))
    slow = engine.add_request("x", SamplingParams(regex="(?:a|aa){40,}c", max_tokens=100,
                                                  top_k=1, n=2))
    good = engine.add_request("Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [c.finish_reason for c in finished[slow].outputs] == ["error", "error"]
    assert finished[slow].error.param == "regex"
    assert str(finished[slow].error).startswith("regex: matching the output took over 0.5 s")
    assert finished[good].outputs[0].finish_reason == "length"
    assert engine.kv_cache.block_pool.num_free_blocks == engine.num_gpu_blocks


def test_a_huge_structured_outputs_regex_is_refused_before_compiling(tiny):
    """structured_outputs.regex is bounded like SGLang's regex=: compiling a{100000000}
    would take more memory than the machine has."""
    from labkit.engine.structured import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a{100000000}"))
    with pytest.raises(ValueError, match="expands to about 100000000 elements") as err:
        LLMEngine(EngineArgs(tiny)).process_inputs("x", params)
    assert err.value.param == "regex"  # the field inside structured_outputs, as for json


def test_choice_seeds_wrap_around_64_bits(tiny):
    """seed=2**63-1 is a valid seed, so n=2 with it is a valid request: choice 1 gets
    seed + 1 modulo 2**64, the generator of seed -2**63."""
    params = SamplingParams(n=2, seed=2**63 - 1, temperature=1.0, max_tokens=6,
                            ignore_eos=True)
    assert params.for_choice(1).seed == -2**63
    llm = LLM(tiny)
    texts = [c.text for c in llm.generate("Hello", params)[0].outputs]
    alone = llm.generate("Hello", SamplingParams(seed=-2**63, temperature=1.0, max_tokens=6,
                                                 ignore_eos=True))[0].outputs[0].text
    assert texts[1] == alone


def test_a_stop_string_written_before_min_tokens_does_not_stop_later(tiny):
    """vLLM looks for a stop string only in text that ends after min_tokens: "ab" written
    while min_tokens held the check back must not stop the request when "c" comes, even
    though a longer stop string widens the window at the end of the text."""
    from labkit.engine.detokenizer import IncrementalDetokenizer
    from labkit.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny)
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    detokenizer = IncrementalDetokenizer(tokenizer, ["ab", "xxxxxxxx"])
    assert [detokenizer.update(a, False), detokenizer.update(b, False)] == [None, None]
    assert detokenizer.update(c) is None and detokenizer.text == "abc"
    spanning = IncrementalDetokenizer(tokenizer, ["bc"])  # ends in the new text: found
    spanning.update(a, False), spanning.update(b, False)
    assert spanning.update(c) == "bc" and spanning.text == "a"


def test_min_tokens_masks_the_stop_tokens_as_vllm_does(tiny):
    """Until min_tokens are out, a stop token cannot be sampled (vLLM's min-tokens logits
    processor); it is not sampled, ignored and left in the output. Here greedy decoding
    starts with token t twice: with stop_token_ids=[t] and min_tokens=3 the first three
    tokens are others, and t, once allowed again, stops the request."""
    llm = LLM(tiny)
    prompt = [5, 17, 42]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    stop = free[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=3,
                                                stop_token_ids=[stop]))[0].outputs[0]
    assert stop not in out.token_ids[:3]
    assert out.finish_reason == "length" or out.token_ids.index(stop) >= 3
    assert out.stop_reason in (None, stop)
    # EOS likewise, unless ignore_eos makes it an ordinary token.
    engine = llm.llm_engine
    eos = engine.tokenizer.eos_token_id
    request = engine.process_inputs(prompt, SamplingParams(min_tokens=2))[0]
    assert not request.sampling_mask(engine.vocab_size)[eos]
    ignoring = engine.process_inputs(prompt, SamplingParams(min_tokens=2, ignore_eos=True))[0]
    assert ignoring.sampling_mask(engine.vocab_size) is None


def test_final_only_reports_a_request_once_when_it_finishes(tiny):
    """vLLM's RequestOutputKind: a stream reads every step (CUMULATIVE); the offline API asks
    for FINAL_ONLY, and gets the same final output without a snapshot per token."""
    engine = LLMEngine(EngineArgs(tiny))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="every-step")
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                 output_kind=RequestOutputKind.FINAL_ONLY),
                       request_id="final-only")
    seen = {"every-step": [], "final-only": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert [o.finished for o in seen["every-step"]] == [False] * 4 + [True]
    assert [o.finished for o in seen["final-only"]] == [True]
    assert seen["final-only"][0].outputs == seen["every-step"][-1].outputs


def _engine_with_blocks(tiny, num_blocks, block_size=4, **args):
    """An engine whose simulated device leaves exactly ``num_blocks`` KV blocks."""
    from labkit.hardware import activation_bytes, kv_cache_bytes_per_token
    from labkit.units import GiB

    probe = LLMEngine(EngineArgs(tiny, block_size=block_size, **args))
    spec = probe.model.spec
    need = (probe.model.weight_bytes + activation_bytes(
        spec, probe.args.max_num_batched_tokens, probe.args.max_num_seqs, act_dtype_bytes=4)
        + num_blocks * block_size * kv_cache_bytes_per_token(spec, "fp32"))
    engine = LLMEngine(EngineArgs(tiny, block_size=block_size,
                                  device_memory_gib=(need + 1) / 0.9 / GiB, **args))
    assert engine.num_gpu_blocks == num_blocks
    return engine


def test_step_stats_add_up_to_what_the_engine_did(tiny):
    """Each step's records (vLLM's SchedulerStats and IterationStats) count that step only:
    summed over the run they give every prompt, token, lookup and preemption exactly once."""
    from labkit.engine.stats import IterationStats

    # 12 blocks of 4 tokens; three requests of up to 8 + 12 tokens (5 blocks each) cannot
    # all run at once, so the scheduler preempts.
    engine = _engine_with_blocks(tiny, 12, max_model_len=40)
    prompts = [[7, 8, 9, 10, 11 + i, 12, 13, 14] for i in range(3)]  # one shared full block
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    steps, running = [], []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_stats)
        running.append(engine.last_stats.scheduler.num_running_reqs)
    iteration = [s.iteration for s in steps]

    def total(field):
        return sum(getattr(i, field) for i in iteration)

    assert engine.scheduler.num_preemptions > 0
    assert total("num_preempted_reqs") == engine.scheduler.num_preemptions
    assert total("num_prompt_tokens") == 3 * 8
    assert total("num_generation_tokens") == 3 * 12
    lookups = [s.scheduler.prefix_cache_stats for s in steps]
    assert sum(x.queries for x in lookups) == engine.kv_cache.prefix_cache_queries > 0
    assert sum(x.hits for x in lookups) == engine.kv_cache.prefix_cache_hits > 0
    assert sum(len(i.time_to_first_tokens_iter) for i in iteration) == 3
    assert sum(len(i.inter_token_latencies_iter) for i in iteration) == 3 * 11
    assert sum(len(i.e2e_latencies_iter) for i in iteration) == 3
    assert running[-1] == 0 and max(running) <= 3
    assert steps[-1].scheduler.kv_cache_usage == 0.0
    assert all(x >= 0 for i in iteration for x in i.inter_token_latencies_iter)
    assert all(isinstance(i, IterationStats) for i in iteration) and len(ids) == 3


def test_metrics_are_the_sum_of_the_step_records(tiny):
    from labkit.engine.metrics import EngineMetrics
    from labkit.http.metrics import sample_totals
    from prometheus_client import generate_latest

    engine = _engine_with_blocks(tiny, 12, max_model_len=40)
    metrics = EngineMetrics("tiny")
    for i in range(3):
        engine.add_request([7, 8, 9, 10, 11 + i, 12, 13, 14],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.record(engine.last_stats.scheduler, engine.last_stats.iteration)
    page = generate_latest(metrics.registry).decode()
    totals = sample_totals(page, [
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running"])
    kv = engine.kv_cache
    assert totals == {
        "vllm:prompt_tokens_total": 24, "vllm:generation_tokens_total": 36,
        "vllm:num_preemptions_total": engine.scheduler.num_preemptions,
        "vllm:prefix_cache_queries_total": kv.prefix_cache_queries,
        "vllm:prefix_cache_hits_total": kv.prefix_cache_hits,
        "vllm:time_to_first_token_seconds_count": 3,
        "vllm:inter_token_latency_seconds_count": 33,
        "vllm:e2e_request_latency_seconds_count": 3, "vllm:num_requests_running": 0}
