"""Speculative decoding in the teaching engine: vLLM's n-gram proposer, its config, greedy
verification, and the two things that must hold whatever the drafts are: the output is the
output without speculation, and no KV block is lost."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.engine import LLM, EngineArgs, LLMEngine, SamplingParams, write_tiny_model
from labkit.engine.speculative import (NgramProposer, SpeculativeConfig, propose_ngram,
                                       verify_greedy, verify_sampled)
from labkit.units import cdiv

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


# -- the proposer ----------------------------------------------------------------------------

def test_propose_ngram_by_hand():
    # The suffix [1, 2] occurred at the start: propose what followed it, into the suffix.
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 2, 2) == [3, 4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2], 9, 2, 2) == [3, 4, 1, 2]  # stops at the end
    # The longest suffix wins: [7, 1, 2] (length 3) over the earlier [1, 2].
    assert propose_ngram([1, 2, 5, 7, 1, 2, 6, 7, 1, 2], 1, 1, 3) == [6]
    # Among equally long matches the earliest: [9, 9] at 0 and at 1.
    assert propose_ngram([9, 9, 9, 4], 2, 1, 1) == []  # the suffix [4] never occurred before
    assert propose_ngram([9, 9, 9], 2, 2, 2) == [9]
    assert propose_ngram([3, 5, 3, 6, 3], 1, 1, 1) == [5]
    # Too short a sequence, or a suffix shorter than min_n that matches: nothing.
    assert propose_ngram([1], 4, 1, 1) == []
    assert propose_ngram([1, 2, 1], 4, 2, 2) == []


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build (make vllm-env) absent")
@settings(max_examples=1, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=40),
                          st.integers(1, 4), st.integers(0, 3), st.integers(1, 6)),
                min_size=300, max_size=300))
def test_propose_ngram_is_vllms(cases):
    """Our proposer against vLLM's own ``_find_longest_matched_ngram_and_propose_tokens``,
    run in vLLM's CPU build, on 300 random sequences over a 4-token vocabulary (many
    repeats) and random n-gram bounds and draft lengths."""
    cases = [(tokens, low, low + extra, k) for tokens, low, extra, k in cases]
    script = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
out = [_find_longest_matched_ngram_and_propose_tokens(
    np.array(tokens, dtype=np.int32), low, high, 10**6, k).tolist()
    for tokens, low, high, k in json.load(sys.stdin)]
print(json.dumps(out))
"""
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=120, check=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [propose_ngram(tokens, k, low, high) for tokens, low, high, k in cases]
    assert ours == theirs


def test_ngram_proposer_respects_its_limits():
    proposer = NgramProposer(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=2))
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert proposer.propose(tokens, 10) == [3, 4, 5]  # num_speculative_tokens
    assert proposer.propose(tokens, 2) == [3, 4]  # what the request may still produce
    assert proposer.propose(tokens, 0) == []


# -- the config ------------------------------------------------------------------------------

def test_speculative_config_reads_vllms_keys():
    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 4, '
                                         '"prompt_lookup_max": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == (4, 3, 3)  # a missing bound takes the other's value
    assert SpeculativeConfig.from_dict({"method": "ngram",
                                        "num_speculative_tokens": 2}).prompt_lookup_min == 5


@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not implemented"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "does not implement draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_speculative_config_refuses_what_it_does_not_implement(config, words):
    with pytest.raises(ParameterError, match=words) as err:
        SpeculativeConfig.from_dict(config)
    assert err.value.param == "speculative_config"


# -- verification ----------------------------------------------------------------------------

def test_verify_greedy_by_hand():
    rows = np.eye(5)[[2, 3, 4, 1]]  # the model's choices: 2, then 3, then 4, then 1
    argmax = lambda row: int(np.argmax(row))  # noqa: E731
    assert verify_greedy([2, 3, 4], rows, argmax) == [2, 3, 4, 1]  # all kept, plus a bonus
    assert verify_greedy([2, 0, 4], rows[:4], argmax) == [2, 3]  # second draft rejected
    assert verify_greedy([1, 3, 4], rows, argmax) == [2]  # first rejected: one token, as usual
    assert verify_greedy([], rows[:1], argmax) == [2]
    with pytest.raises(ParameterError, match="3 drafts need 4 rows"):
        verify_greedy([2, 3, 4], rows[:3], argmax)


# -- the engine: same output, no block lost --------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine_for(model, config=None, **kw):
    return LLMEngine(EngineArgs(model=str(model), speculative_config=config, **kw))


def run(engine, prompts, params):
    """Every request to the end, checking after each step that a running request holds
    exactly the blocks of its computed tokens (those of rejected drafts were handed back)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    outputs, drafts, accepted = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        spec = engine.last_stats.spec_decoding
        if spec is not None:
            drafts += spec.num_draft_tokens
            accepted += spec.num_accepted_tokens
        kv = engine.kv_cache
        for request in engine.scheduler.running:
            assert len(kv.get_block_ids(request.request_id)) == cdiv(
                request.num_computed_tokens, kv.block_size)
    assert engine.kv_cache.block_pool.num_free_blocks == engine.num_gpu_blocks
    return outputs, drafts, accepted


REPEATING = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_is_unchanged_by_speculation(tiny, k):
    prompts = [REPEATING, "abc abc abc abc", "a story: once upon a time", "x"]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (40, 33, 25, 9)]
    plain, _, _ = run(engine_for(tiny), prompts, params)
    config = SpeculativeConfig(k, prompt_lookup_min=1, prompt_lookup_max=3)
    spec, drafts, accepted = run(engine_for(tiny, config), prompts, params)
    assert spec == plain
    assert 0 < accepted <= drafts  # drafts were made and some kept: the test is not vacuous


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(3, 12), min_size=1, max_size=40), min_size=1,
                        max_size=5),
       max_tokens=st.lists(st.integers(1, 30), min_size=5, max_size=5),
       k=st.integers(1, 6), block_size=st.sampled_from([1, 2, 4, 16]),
       stop=st.lists(st.integers(3, 12), max_size=2))
def test_speculation_loses_no_block_and_changes_no_token(tiny, prompts, max_tokens, k,
                                                         block_size, stop):
    """Random token prompts over a small vocabulary (so n-grams repeat), random lengths,
    stop tokens and block sizes down to one token a block: the same tokens as without
    speculation, every running request holding exactly its computed tokens' blocks after
    every step, and every block free at the end."""
    params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=stop)
              for m in max_tokens[:len(prompts)]]
    args = {"block_size": block_size, "max_num_batched_tokens": 64}
    plain, _, _ = run(engine_for(tiny, **args), prompts, params)
    config = SpeculativeConfig(k, prompt_lookup_min=1, prompt_lookup_max=2)
    spec, _, _ = run(engine_for(tiny, config, **args), prompts, params)
    assert spec == plain


def test_the_offline_api_takes_vllms_speculative_config(tiny):
    llm = LLM(model=str(tiny), speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 3,
                                                   "prompt_lookup_max": 2})
    plain = LLM(model=str(tiny))
    params = SamplingParams(temperature=0, max_tokens=30)
    assert (llm.generate([REPEATING], params)[0].outputs[0].text
            == plain.generate([REPEATING], params)[0].outputs[0].text)
    with pytest.raises(ParameterError, match="speculative_config"):
        LLM(model=str(tiny), speculative_config={"num_speculative_tokens": -1})


# -- rejection sampling ----------------------------------------------------------------------

def frequencies_match(counts, n, p, sigmas=5.0):
    """Every count within ``sigmas`` binomial standard deviations of ``n * p``."""
    return all(abs(c - n * q) <= sigmas * np.sqrt(n * q * (1 - q)) + 1e-9
               for c, q in zip(counts, p, strict=True))


P0 = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
P1 = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
P2 = np.full(5, 0.2)


def emitted_frequencies(verifier, n=20000, seed=0):
    """Verify drafts [1, 2] against P0, P1, P2 ``n`` times: the counts of the first emitted
    token, and of the second given that the first was the draft."""
    rng = np.random.default_rng(seed)
    first, second = np.zeros(5), np.zeros(5)
    for _ in range(n):
        out = verifier([1, 2], [P0, P1, P2], rng)
        first[out[0]] += 1
        if out[0] == 1 and len(out) > 1:  # the draft was kept
            second[out[1]] += 1
    return first, second


def test_rejection_sampling_keeps_the_models_distribution():
    """The first token is distributed as P0 and, after the first draft, the second as P1,
    though the drafts are fixed guesses: speculation changes the speed, not the output's
    distribution (Leviathan et al. 2023, theorem 3.5)."""
    first, second = emitted_frequencies(verify_sampled)
    assert frequencies_match(first, first.sum(), P0)
    assert frequencies_match(second, second.sum(), P1)


def test_the_distribution_check_catches_a_wrong_sampler():
    """The same check on a plausible mistake, redrawing a rejected draft from the whole of p
    (the draft may come back): the draft comes out too often, and the check says so."""
    def redraw_from_p(drafts, probs, rng):
        if rng.random() < probs[0][drafts[0]]:
            return [drafts[0], int(rng.choice(5, p=probs[1]))]
        return [int(rng.choice(5, p=probs[0]))]

    first, _ = emitted_frequencies(redraw_from_p)
    assert not frequencies_match(first, first.sum(), P0)


def test_rejection_sampling_by_hand():
    rng = np.random.default_rng(0)
    sure = np.eye(3)[[2, 0, 1]]  # the model is certain: 2, then 0, then 1
    assert verify_sampled([2, 0], list(sure), rng) == [2, 0, 1]  # both kept, bonus 1
    assert verify_sampled([2, 1], list(sure), rng) == [2, 0]  # the 1 cannot be kept
    with pytest.raises(ParameterError, match="2 drafts need 3 distributions"):
        verify_sampled([2, 1], list(sure[:2]), rng)


def test_sampled_requests_are_speculated_and_lose_nothing(tiny):
    """Sampled requests verify drafts by rejection sampling; requests that ask for logprobs
    decode one token a step; every block comes back (``run`` checks after every step)."""
    config = SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=2)
    sampled = [SamplingParams(temperature=t, seed=s, max_tokens=40, top_k=k)
               for t, s, k in ((0.3, 1, -1), (1.0, 2, 5), (0.7, 3, 2))]
    outputs, drafts, accepted = run(engine_for(tiny, config), [REPEATING] * 3, sampled)
    assert drafts > 0 and accepted > 0
    assert all(len(tokens) == 40 for tokens in outputs.values())
    _, drafts, _ = run(engine_for(tiny, config), [REPEATING],
                       [SamplingParams(temperature=0, max_tokens=20, logprobs=2)])
    assert drafts == 0


def test_labkit_serve_refuses_a_config_it_does_not_implement(tiny, capsys):
    """At start-up, before any port is bound: the key named, exit status 2."""
    from labkit import cli
    status = cli.main(["serve", str(tiny), "--port", "1", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_'
                       'parallel_size": 1}'])
    assert status == 2
    assert "does not implement draft_tensor_parallel_size" in capsys.readouterr().err
    from labkit.engine.args import parse_engine_args
    args = parse_engine_args([str(tiny), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert args.speculative_config == SpeculativeConfig(2)


@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(3, 8), min_size=30, max_size=40), min_size=5,
                        max_size=6),
       k=st.integers(1, 5), temperature=st.sampled_from([0.0, 0.8]))
def test_speculation_under_memory_pressure(tiny, prompts, k, temperature):
    """A cache of 42 blocks of 4 tokens for requests of up to 70 tokens: requests are
    preempted and recomputed, drafts find no free block and are dropped. Greedy output is
    still unchanged, sampled requests finish, and every block comes back (``run``). Prefix
    caching is off, so that equal prompts share no block and the pressure is real."""
    args = {"block_size": 4, "device_memory_gib": 0.0023, "max_model_len": 128,
            "enable_prefix_caching": False,
            "max_num_batched_tokens": 64, "max_num_seqs": 8}
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=30)
              for i in range(len(prompts))]
    plain_engine = engine_for(tiny, **args)
    assert plain_engine.num_gpu_blocks == 42
    plain, _, _ = run(plain_engine, prompts, params)
    config = SpeculativeConfig(k, prompt_lookup_min=1, prompt_lookup_max=2)
    spec_engine = engine_for(tiny, config, **args)
    spec, _, _ = run(spec_engine, prompts, params)
    assert plain_engine.scheduler.num_preemptions > 0  # the pressure is real
    assert len(spec) == len(prompts)  # every request finished (a sampled one may stop early)
    if temperature == 0:
        assert spec == plain
