"""Speculation traced step by step in the teaching engine, and measured through a server's own
counters (labkit.harness.speculation): the teaching engine's servers, plain then speculating,
on the course's tiny model."""

import pytest

from labkit.checks import ParameterError
from labkit.engine import LLM, EngineArgs, LLMEngine, SamplingParams, write_tiny_model
from labkit.harness.speculation import (SpeculationComparison, SpeculationRun,
                                        measure_speculation, repetitive_prompts,
                                        speculation_sweep, trace_speculation, varied_prompts)
from labkit.lab import LabPath

TEACHING = LabPath(gpus=(), engines=(), forced=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}


def test_the_counters_give_vllms_two_ratios():
    # 10 verification steps, 30 draft tokens, 21 accepted: vLLM logs an acceptance rate of
    # 21 / 30 = 70 % and a mean acceptance length of 1 + 21 / 10 = 3.1 tokens per step.
    run = SpeculationRun(1, 64, 2.0, ("x",), num_drafts=10, num_draft_tokens=30,
                         num_accepted_tokens=21)
    assert run.acceptance_rate == pytest.approx(0.7)
    assert run.mean_acceptance_length == pytest.approx(3.1)
    assert run.tokens_per_s == 32
    plain = SpeculationRun(1, 64, 4.0, ("x",))
    assert plain.acceptance_rate is None and plain.mean_acceptance_length is None
    both = SpeculationComparison("w", plain, run)
    assert both.speedup == 2.0 and both.same_output
    assert not SpeculationComparison("w", plain, SpeculationRun(1, 64, 2.0, ("y",))).same_output


def test_workloads_are_deterministic_and_differ():
    assert repetitive_prompts(3) == repetitive_prompts(3)
    assert len(set(varied_prompts(4))) == 4
    with pytest.raises(ParameterError) as err:
        varied_prompts(0)
    assert err.value.param == "n"


def test_bad_measurements_are_refused_before_any_request():
    for kwargs, param in (({"concurrency": 0, "output_len": 8}, "concurrency"),
                          ({"concurrency": 1, "output_len": -1}, "output_len")):
        with pytest.raises(ParameterError) as err:
            measure_speculation("http://127.0.0.1:9", "m", ["p"], **kwargs)
        assert err.value.param == param
    with pytest.raises(ParameterError) as err:
        measure_speculation("http://127.0.0.1:9", "m", [], 1, 8)
    assert err.value.param == "prompts"


def test_a_sweep_on_the_teaching_engine_keeps_the_text_and_counts_the_drafts():
    sweep = speculation_sweep(NGRAM, {"repetitive": repetitive_prompts(3),
                                      "varied": varied_prompts(2)}, (1, 2), output_len=24,
                              path=TEACHING)
    assert (sweep.engine, sweep.runs, len(sweep.rows)) == ("labkit", "teaching", 4)
    assert sweep.label == "labkit serve (the teaching engine)"
    for row in sweep.rows:
        assert row.same_output, row.workload
        assert row.plain.num_drafts == 0                 # the plain server never speculates
        spec = row.speculative
        assert spec.num_accepted_tokens <= spec.num_draft_tokens <= 3 * spec.num_drafts
    repetitive = sweep.rows[0].speculative
    assert repetitive.num_drafts > 0 and 0 < repetitive.acceptance_rate <= 1
    assert "same text" in sweep.table() and "NO" not in sweep.table()
    assert [c for c, _ in sweep.speedups()["varied"]] == [1, 2]
    rate, length = sweep.acceptance()["repetitive"]
    assert 0 < rate <= 1 and 1 < length <= 1 + 3    # at most k = 3 drafts kept a step


def test_a_trace_shows_every_step_and_adds_up_to_the_plain_output(tmp_path):
    write_tiny_model(tmp_path)
    prompt = "the cat sat on the mat. " * 4
    speculating = LLMEngine(EngineArgs(model=str(tmp_path), speculative_config=NGRAM))
    steps = trace_speculation(speculating, prompt, 40)
    plain = LLM(str(tmp_path)).generate(prompt, SamplingParams(temperature=0, max_tokens=40,
                                                               ignore_eos=True))
    # Greedy: the steps' tokens, end to end, are the plain engine's output.
    assert [t for step in steps for t in step.emitted] == plain[0].outputs[0].token_ids
    for step in steps:
        assert len(step.drafts) <= 3 and 1 <= len(step.emitted) <= len(step.drafts) + 1
        # The kept drafts are a prefix of the drafts; the last token is the model's own.
        assert step.emitted[:step.num_accepted] == step.drafts[:step.num_accepted]
        # Rejected drafts' slots are handed back: the blocks hold the cached tokens, no more.
        assert step.blocks == -(-step.cached_tokens // 16)
    assert len(steps) < 40                      # some steps emitted more than one token
    assert steps[-1].blocks == 0 and not speculating.has_unfinished_requests()
    kv = speculating.kv_cache
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    with pytest.raises(ParameterError) as err:
        trace_speculation(LLMEngine(EngineArgs(model=str(tmp_path))), prompt, 4)
    assert err.value.param == "engine"
