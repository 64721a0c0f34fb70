"""Speculation in the simulator (labkit.simulate.speculation.SimulatedSpeculation): the steps
worked out by hand, the papers' tokens per step recovered by Monte Carlo, the analytic gain of
chapter 9 recovered at batch 1, nothing changed in what the requests emit, no block lost."""

import pytest

from labkit.checks import ParameterError
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig, StaticBatchScheduler
from labkit.simulate import RooflineCost, Workload, simulate
from labkit.simulate.speculation import (SimulatedSpeculation, expected_tokens_per_step,
                                         speculative_decode_gain)


def one_second_per_step(rows):
    return 1.0


def run(requests, speculation, cost=one_second_per_step, blocks=4000):
    scheduler = Scheduler(KVCacheManager(blocks, 16), SchedulerConfig(64, 4096))
    result = simulate(scheduler, requests, cost, speculation=speculation)
    assert scheduler.kv_cache.block_pool.num_free_blocks == blocks  # every block back
    return result


def test_every_draft_kept_by_hand():
    # 13 planned tokens, 4 drafts a step, all kept: the prefill emits token 1, then steps of
    # 5 tokens emit 2-6 and 7-11, and the last step may draft only 1 (13 - 11 - 1 = 1 left
    # after the token the model adds): 12-13. Four steps instead of 13.
    plan = list(range(100, 113))
    request = Request("a", list(range(10)), plan)
    result = run([request], SimulatedSpeculation(4, 1.0))
    assert len(result.steps) == 4
    assert [s.num_tokens for s in result.steps] == [10, 5, 5, 2]
    assert request.token_ids[10:] == plan


def test_no_draft_kept_is_a_plain_decode_paying_for_its_drafts():
    plan = list(range(100, 113))
    plain = run([Request("a", list(range(10)), plan)], None)
    request = Request("a", list(range(10)), plan)
    spec = run([request], SimulatedSpeculation(4, 0.0))
    assert len(spec.steps) == len(plain.steps) == 13      # one token a step, as without
    assert request.token_ids[10:] == plan
    # ... but every decode step carried up to 4 drafts the cost model charges for.
    assert sum(s.num_tokens for s in spec.steps) > sum(
        s.num_tokens for s in plain.steps)


def test_the_papers_tokens_per_step_come_out_of_the_simulation():
    k, a, n = 4, 0.7, 4000
    result = run([Request("a", [1, 2, 3], list(range(n)))], SimulatedSpeculation(k, a, seed=1))
    decode_steps = len(result.steps) - 1          # the prefill emitted one token
    assert (n - 1) / decode_steps == pytest.approx(expected_tokens_per_step(a, k), rel=0.02)


def test_at_batch_one_the_simulator_agrees_with_the_roofline_gain():
    # One request decoding 2,000 tokens after a 256-token prompt: its time per output token
    # with and without speculation should differ by chapter 9's analytic speed-up.
    cost = RooflineCost("Llama-3-8B", "H100 SXM")

    def tpot(speculation):
        result = run([Request("a", list(range(256)), list(range(2000)))], speculation, cost)
        return result.summary().mean_tpot_ms

    gain = speculative_decode_gain("Llama-3-8B", "H100 SXM", 1, 1256, 4, 0.7)
    assert tpot(None) / tpot(SimulatedSpeculation(4, 0.7, seed=2)) == pytest.approx(
        gain.speedup, rel=0.03)


def test_a_draft_model_costs_its_share_of_a_step():
    plan = list(range(100, 113))
    free = run([Request("a", list(range(10)), plan)], SimulatedSpeculation(4, 1.0))
    paid = run([Request("a", list(range(10)), plan)], SimulatedSpeculation(4, 1.0, 0.5))
    # One second a step, plus half a plain step for each of the 3 steps that drafted.
    assert paid.steps[-1].end_s - free.steps[-1].end_s == pytest.approx(1.5)


def test_a_loaded_server_emits_the_same_tokens_and_loses_no_block():
    workload = Workload.fixed(200, 64, 60, seed=3).at_rate(50.0)
    plain_requests, spec_requests = workload.requests(), workload.requests()
    cost = RooflineCost("Llama-3-8B", "H100 SXM")
    run(plain_requests, None, cost, blocks=2000)
    run(spec_requests, SimulatedSpeculation(4, 0.6, seed=4), cost, blocks=2000)
    assert [r.token_ids for r in spec_requests] == [r.token_ids for r in plain_requests]
    assert all(r.is_finished for r in spec_requests)


def test_static_batching_cannot_speculate():
    with pytest.raises(ParameterError) as err:
        simulate(StaticBatchScheduler(KVCacheManager(100, 16), 4), [Request("a", [1], [2])],
                 one_second_per_step, speculation=SimulatedSpeculation(2, 0.5))
    assert err.value.param == "speculation"


@pytest.mark.parametrize("kwargs, param", [
    ({"num_speculative_tokens": 0, "acceptance_rate": 0.5}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "acceptance_rate": 1.5}, "acceptance_rate"),
    ({"num_speculative_tokens": 2, "acceptance_rate": float("nan")}, "acceptance_rate"),
    ({"num_speculative_tokens": 2, "acceptance_rate": 0.5, "draft_cost": -1}, "draft_cost"),
])
def test_bad_speculation_is_refused_by_name(kwargs, param):
    with pytest.raises(ParameterError) as err:
        SimulatedSpeculation(**kwargs)
    assert err.value.param == param
