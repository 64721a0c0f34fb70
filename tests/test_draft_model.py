"""Speculative decoding with a draft model (labkit.engine.draft_model): vLLM's keys and rules,
greedy output unchanged, a draft that is the target accepted every time, a 4-bit copy of the
target (chapter 4's quantizer) accepted part of the time, no block lost."""

import json

import numpy as np
import pytest

from labkit.checks import ParameterError
from labkit.engine import EngineArgs, LLMEngine, SamplingParams, write_tiny_model
from labkit.engine.draft_model import DraftModelProposer
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.speculative import SpeculativeConfig
from labkit.quant.model import quantize_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_model(root / "target")
    return target, quantize_checkpoint(target, root / "draft", "rtn-int4")


def draft_config(model, k=3):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def test_vllms_rules_for_the_method():
    # No method: "draft_model" with a model, "ngram" when the model is "ngram" (vLLM's
    # SpeculativeConfig.__post_init__).
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 2}) == \
        SpeculativeConfig(2, "draft_model", model="/m")
    assert SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2}) == \
        SpeculativeConfig(2, "ngram")
    for config, words in (({"num_speculative_tokens": 2}, "goes with method 'draft_model'"),
                          ({"method": "draft_model", "num_speculative_tokens": 2},
                           "goes with method 'draft_model'"),
                          ({"model": "/m", "num_speculative_tokens": 2,
                            "prompt_lookup_max": 3}, "are for method 'ngram'")):
        with pytest.raises(ParameterError, match=words) as err:
            SpeculativeConfig.from_dict(config)
        assert err.value.param == "speculative_config"


def test_the_proposer_drafts_the_drafts_greedy_continuation(models):
    target, draft = models
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    proposer = DraftModelProposer(SpeculativeConfig(4, "draft_model", model=str(draft)), vocab,
                                  max_model_len=256)
    prompt = [1, 57, 200, 31, 9, 77]
    drafts = proposer.propose(prompt, max_tokens=10)
    # By hand: the draft alone, one token at a time, each time over the whole sequence in a
    # fresh cache, taking the argmax.
    model, tokens = LlamaModel.load(draft, 16, 16), list(prompt)
    for _ in range(4):
        logits = model.forward([SequenceBatch(tokens, 0, list(range(16)))])[0][-1]
        tokens.append(int(np.argmax(logits)))
    assert drafts == tokens[len(prompt):]
    assert proposer.propose(prompt, max_tokens=2) == drafts[:2]  # what the request may emit
    assert proposer.propose(prompt, max_tokens=0) == []
    assert proposer.propose(prompt + drafts[:1], 4)[:3] == drafts[1:]  # no state between calls


def test_a_draft_of_another_vocabulary_or_no_model_is_refused(models, tmp_path):
    target, _ = models
    other = write_tiny_model(tmp_path / "other", vocab_size=384)
    for model, words in ((other, "vocabulary has"), (tmp_path / "missing", "not a model")):
        with pytest.raises(ParameterError, match=words) as err:
            LLMEngine(EngineArgs(model=str(target), speculative_config=draft_config(model)))
        assert err.value.param == "speculative_config"


def run(engine, prompts, params):
    """Every prompt to the end; the outputs, and the engine's draft and accepted counts."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    outputs, drafts, accepted = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        spec = engine.last_stats.spec_decoding
        if spec is not None:
            drafts, accepted = drafts + spec.num_draft_tokens, accepted + spec.num_accepted_tokens
    kv = engine.kv_cache
    assert kv.block_pool.num_free_blocks == kv.num_blocks  # every block back
    return [outputs[str(i)] for i in range(len(prompts))], drafts, accepted


PROMPTS = ["the key value cache stores", "Hello world! What is", "one, two, three"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_greedy_output_is_unchanged_by_a_draft_model(models):
    target, draft = models
    plain, _, _ = run(LLMEngine(EngineArgs(model=str(target))), PROMPTS, GREEDY)
    speculated, drafts, accepted = run(
        LLMEngine(EngineArgs(model=str(target), speculative_config=draft_config(draft))),
        PROMPTS, GREEDY)
    assert speculated == plain
    # 4-bit weights change some of the draft's choices: a part of its drafts is kept.
    assert 0 < accepted < drafts


def test_the_target_as_its_own_draft_is_accepted_every_time(models):
    target, _ = models
    engine = LLMEngine(EngineArgs(model=str(target), speculative_config=draft_config(target)))
    _, drafts, accepted = run(engine, PROMPTS, GREEDY)
    assert drafts > 0 and accepted == drafts


def test_sampled_requests_with_a_draft_model_lose_nothing(models):
    target, draft = models
    engine = LLMEngine(EngineArgs(model=str(target), speculative_config=draft_config(draft),
                                  seed=0))
    outputs, drafts, _ = run(engine, PROMPTS, SamplingParams(temperature=0.8, max_tokens=24,
                                                             ignore_eos=True))
    assert [len(o) for o in outputs] == [24, 24, 24] and drafts > 0
