"""$ per 1M tokens (chapter 6.1) and the throughput at an SLO it is priced from (6.2):
hand-derived numbers, the tutorial's formula against ours, the input/output split."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.checks import ParameterError
from labkit.cost.capacity import LatencySLO, max_rate_at_slo
from labkit.simulate.deployment import Deployment, TensorParallelRooflineCost
from labkit.cost.prices import GPUPrice
from labkit.cost.tokens import (Throughput, busy_time_s, prefill_only_time_s, prefill_share,
                                throughput_from_benchmark, token_cost)
from labkit.tutorial.ch06_cost import tutorial_cost_per_million_tokens
from labkit.kvcache import KVCacheManager
from labkit.parallel import tp_decode_scaling
from labkit.scheduling import Scheduler, SchedulerConfig
from labkit.simulate import RequestLatencies, Workload, simulate, summarize_latencies


def _throughput(input_tok_s=2000.0, output_tok_s=500.0, share=0.25, num_gpus=2):
    return Throughput(input_tok_s, output_tok_s, 4.0, share, num_gpus, "given by the test")


def test_cost_per_million_tokens_worked_by_hand():
    # 2 GPUs at $2/GPU-hour = $4/hour = $0.001111/s; at 50 % utilization a useful second
    # costs $0.002222. Prefill takes 25 % of it: 0.002222 * 0.25 / 2000 tok/s * 1e6
    # = $0.27778 per 1M input; decode 75 %: 0.002222 * 0.75 / 500 * 1e6 = $3.3333 per 1M
    # output; all tokens: 0.002222 / 2500 * 1e6 = $0.88889.
    cost = token_cost(_throughput(), 2.0, utilization=0.5)
    assert math.isclose(cost.usd_per_1m_input, 0.277778, rel_tol=1e-5)
    assert math.isclose(cost.usd_per_1m_output, 3.333333, rel_tol=1e-6)
    assert math.isclose(cost.usd_per_1m_blended, 0.888889, rel_tol=1e-6)
    assert cost.usd_per_replica_hour == 4.0
    assert "given by the test" in cost.provenance and "$2 per GPU-hour" in cost.provenance


def test_utilization_is_honoured_and_the_tutorial_ignores_it():
    full = token_cost(_throughput(), 3.5, utilization=1.0)
    half = token_cost(_throughput(), 3.5, utilization=0.5)
    assert math.isclose(half.usd_per_1m_blended, 2 * full.usd_per_1m_blended)
    # The tutorial's cost_per_million_tokens(utilization=...) returns the same at any value.
    tutorial = [tutorial_cost_per_million_tokens(7.0, 2500, u) for u in (1.0, 0.5, 0.1)]
    assert tutorial[0] == tutorial[1] == tutorial[2]
    # ... which is ours at 100 %: $7/h / 3600 / 2500 tok/s * 1e6 = $0.7778.
    assert math.isclose(tutorial[0], full.usd_per_1m_blended)
    assert math.isclose(tutorial[0], 0.777778, rel_tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 1e5), st.floats(0.1, 1e5), st.floats(0.0, 1.0), st.floats(0.05, 1.0),
       st.floats(0.01, 50.0), st.integers(1, 8))
def test_input_and_output_prices_recover_the_whole_bill(inp, out, share, util, usd, gpus):
    cost = token_cost(Throughput(inp, out, 1.0, share, gpus, "hypothesis"), usd, util)
    billed_per_s = usd * gpus / 3600 / util
    recovered = (cost.usd_per_1m_input * inp + cost.usd_per_1m_output * out) / 1e6
    assert math.isclose(recovered, billed_per_s, rel_tol=1e-9)
    assert math.isclose(cost.usd_per_1m_blended * (inp + out) / 1e6, billed_per_s, rel_tol=1e-9)


def test_a_price_row_carries_its_citation():
    row = GPUPrice("L40S", "Somewhere", "spot", 0.5, "https://example.org/p", "2026-10-01")
    cost = token_cost(_throughput(num_gpus=1), row)
    assert "Somewhere" in cost.provenance and "2026-10-01" in cost.provenance


@pytest.mark.parametrize("kwargs, param", [
    ({"share": 1.5}, "prefill_share"), ({"input_tok_s": 0.0}, "input_tok_s"),
    ({"num_gpus": 0}, "num_gpus")])
def test_bad_throughputs_are_refused(kwargs, param):
    with pytest.raises(ParameterError) as err:
        _throughput(**kwargs)
    assert err.value.param == param


def test_bad_cost_inputs_are_refused():
    with pytest.raises(ParameterError) as err:
        token_cost(_throughput(), 2.0, utilization=0.0)
    assert err.value.param == "utilization"
    with pytest.raises(ParameterError) as err:
        token_cost(_throughput(), -1.0)
    assert err.value.param == "price"
    with pytest.raises(ParameterError, match="provenance"):
        Throughput(1.0, 1.0, 1.0, 0.5, 1, " ")


class _Recorder:
    """A cost model that charges 1 ms per token plus 2 ms per step and keeps the rows."""

    def __init__(self):
        self.steps = []

    def __call__(self, rows):
        self.steps.append(list(rows))
        return 1e-3 * sum(n for n, _ in rows) + 2e-3


def test_prefill_only_time_packs_prompts_into_chunks():
    cost = _Recorder()
    # Three prompts of 300 tokens in steps of 512: [300, 212 of the second] then [the last
    # 88 of the second (after 212 computed), 300]: 900 tokens in 2 steps.
    seconds = prefill_only_time_s([300, 300, 300], cost, 512)
    assert cost.steps == [[(300, 0), (212, 0)], [(88, 212), (300, 0)]]
    assert math.isclose(seconds, 900e-3 + 2 * 2e-3)


def test_prefill_share_from_a_simulation_with_a_linear_cost():
    # Each step costs 1 ms per token and nothing else. A request of P prompt tokens and O
    # output tokens computes P + O - 1 tokens (the first output token comes out of the
    # prefill step), so the busy time is 1 ms * n * (P + O - 1) and the prefill share is
    # P / (P + O - 1) = 100 / 150 for P = 100, O = 51.
    def linear(rows):
        return 1e-3 * sum(n for n, _ in rows)

    n = 20
    requests = Workload([0.0] * n, [100] * n, [51] * n, seed=1).at_rate(5.0).requests()
    scheduler = Scheduler(KVCacheManager(4000, 16, enable_prefix_caching=False),
                          SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    run = simulate(scheduler, requests, linear)
    busy = busy_time_s(run)
    assert math.isclose(busy, 1e-3 * n * 150)
    share = prefill_share(prefill_only_time_s([100] * n, linear, 256), busy)
    assert math.isclose(share, 100 / 150)


def test_prefill_longer_than_the_run_is_refused():
    with pytest.raises(ParameterError) as err:
        prefill_share(2.0, 1.0)
    assert err.value.param == "prefill_s"


def test_throughput_from_a_benchmark_run():
    # 10 requests of 100 prompt / 50 output tokens in 10 s: 100 input and 50 output tok/s.
    # A prefill rate of 400 tok/s puts the 1000 prompt tokens at 2.5 s of the 10: share 0.25.
    latencies = [RequestLatencies(f"r{i}", 100, 50, 100.0, 20.0, 1080.0, (20.0,) * 49)
                 for i in range(10)]
    result = summarize_latencies(latencies, 10.0)
    throughput = throughput_from_benchmark(result, num_gpus=1, prefill_tok_s=400.0,
                                           description="labkit serve on a laptop")
    assert (throughput.input_tok_s, throughput.output_tok_s) == (100.0, 50.0)
    assert throughput.prefill_share == 0.25
    assert throughput.provenance.startswith("measured: labkit.bench run, labkit serve")


def test_tensor_parallel_cost_adds_chapter_3_all_reduces():
    cost = TensorParallelRooflineCost("Llama-3-70B", "H100 SXM", 4, allreduce_latency_s=5e-6)
    # The reference: chapter 3.4's decode scaling, whose communication term is the same two
    # ring all-reduces per layer of one hidden row per sequence.
    ref = tp_decode_scaling("Llama-3-70B", "H100 SXM", [4], 64, 1024, latency_s=5e-6)[0]
    assert math.isclose(cost.comm_s(64), ref.comm_s, rel_tol=1e-12)
    # And the fast simulator's path gives what the rows give.
    rows = [(1, 1023)] * 64
    from labkit.simulate.cost import row_totals
    assert math.isclose(cost.time_of_totals(*row_totals(rows)), cost(rows), rel_tol=1e-12)
    single = TensorParallelRooflineCost("Llama-3-8B", "L40S", 1)
    assert single.comm_s(512) == 0.0


@pytest.mark.parametrize("deployment, words", [
    (Deployment("Llama-3-70B", "H100 SXM", 5), "must divide"),
    (Deployment("Llama-3-8B", "A100 80GB", 1, "fp8"), "no fp8 tensor cores"),
    (Deployment("Llama-3-70B", "L40S", 1), "No available memory"),
])
def test_deployments_that_cannot_run_say_why(deployment, words):
    assert words in deployment.problem()
    with pytest.raises(ParameterError, match="cannot run"):
        max_rate_at_slo(deployment, LatencySLO(1000, 50), Workload.fixed(100, 20, 20))


SMALL = Workload.fixed(256, 64, 80, seed=3)
L40S_8B = Deployment("Llama-3-8B", "L40S", max_model_len=1024)


def test_loose_slo_is_bound_by_throughput_and_impossible_slo_gives_zero():
    loose = max_rate_at_slo(L40S_8B, LatencySLO(1e7, 1e7), SMALL)
    assert loose.max_request_rate == loose.saturation_request_rate > 0
    assert loose.provenance.startswith("simulated: Llama-3-8B bf16 on 1 x L40S, roofline")
    impossible = max_rate_at_slo(L40S_8B, LatencySLO(1e-3, 1e-3), SMALL)
    assert impossible.max_request_rate == 0 and not impossible.feasible
    with pytest.raises(ParameterError, match="cannot meet"):
        impossible.throughput()


def test_the_rate_found_meets_the_slo_and_a_slightly_higher_one_does_not():
    loose = max_rate_at_slo(L40S_8B, LatencySLO(1e7, 1e7), SMALL)
    # At saturation the replica's p99 TPOT is the first probe's; 90 % of it must push the
    # rate below saturation (decode steps grow with the batch), and stays above what a
    # lightly loaded replica shows, so the SLO can be met.
    tight = LatencySLO(1e7, 0.9 * loose.probes[0].p99_tpot_ms)
    capacity = max_rate_at_slo(L40S_8B, tight, SMALL, rel_tol=0.05)
    assert 0 < capacity.max_request_rate < capacity.saturation_request_rate
    assert tight.met_by(capacity.summary)
    failed = [p.request_rate for p in capacity.probes if not p.meets_slo]
    above = min(r for r in failed if r > capacity.max_request_rate)
    assert above - capacity.max_request_rate <= 0.05 * above
    throughput = capacity.throughput()
    assert math.isclose(throughput.input_tok_s, capacity.max_request_rate * 256)
    assert math.isclose(throughput.output_tok_s, capacity.max_request_rate * 64)
    assert 0 < throughput.prefill_share < 1
    assert f"{capacity.max_request_rate:.2f} req/s" in throughput.provenance


def test_workload_checks():
    with pytest.raises(ParameterError, match="at least one request"):
        max_rate_at_slo(L40S_8B, LatencySLO(1000, 50), Workload((), (), ()))
    with pytest.raises(ParameterError):
        Workload((0, 0), (10, 0), (5, 5))
    with pytest.raises(ParameterError, match="exceeds max_model_len"):
        max_rate_at_slo(L40S_8B, LatencySLO(1000, 50), Workload.fixed(1000, 100, 10))
    lognormal = Workload.lognormal(200, 50, 30, max_prompt_len=800, max_output_len=200)
    assert max(lognormal.prompt_lens) <= 800 and lognormal.num_requests == 30
