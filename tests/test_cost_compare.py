"""Deployment comparison and monthly cost (chapter 6.3): replicas and bills worked by hand, the
tutorial's sizing against ours, the autoscaled fleet's replica-hours."""

import math

import pytest

from labkit.autoscale import FleetConfig, step_trace
from labkit.checks import ParameterError
from labkit.cost.capacity import LatencySLO, SLOCapacity, max_rate_at_slo
from labkit.simulate import Workload
from labkit.simulate.deployment import Deployment
from labkit.cost.compare import (TrafficProfile, autoscaled_fleet_cost, compare_deployments,
                                 comparison_table, fixed_fleet_cost, monthly_cost_usd,
                                 replicas_needed)
from labkit.cost.prices import GPUPrice
from labkit.hardware import plan_kv_cache
from labkit.tutorial.ch06_cost import (tutorial_compare_deployment, tutorial_gpu_count,
                                       tutorial_monthly_cost)


@pytest.mark.parametrize("peak, per_replica, expected", [
    (14.0, 3.5, 4),    # exactly 4 replicas' worth: 4, not 5
    (14.1, 3.5, 5),    # a little more needs a whole replica more
    (0.5, 3.5, 1),     # any traffic needs one
    (0.3, 0.1, 3),     # 0.3 / 0.1 = 2.9999999999999996 in floats: still 3
])
def test_replicas_needed_rounds_up(peak, per_replica, expected):
    assert replicas_needed(peak, per_replica) == expected


def test_replicas_needed_refuses_a_replica_that_serves_nothing():
    with pytest.raises(ParameterError) as err:
        replicas_needed(10.0, 0.0)
    assert err.value.param == "rate_per_replica"


def test_monthly_cost_pays_every_hour():
    # 4 replicas x 2 GPUs x $3/GPU-hour x 730 h = $17,520, whatever the load.
    assert monthly_cost_usd(4, 2, 3.0) == 17_520
    # The tutorial multiplies by utilization: 5 H100 at $3.50, "70 % utilized", 720 h:
    # 17.5 x 720 x 0.7 = $8,820, where the GPUs bill 17.5 x 730 = $12,775.
    assert math.isclose(tutorial_monthly_cost(3.5 * 5, 0.7), 8820)
    assert math.isclose(monthly_cost_usd(1, 5, 3.5), 12_775)


def _capacity(rate=5.0, tp=2):
    deployment = Deployment("Llama-3-8B", "L40S", tp)
    return SLOCapacity(deployment, LatencySLO(1000, 50), Workload.fixed(500, 200, 10), rate,
                       6.0, None, 0.3, ())


def test_fixed_fleet_worked_by_hand():
    # Peak 12 req/s at 5 req/s per replica -> 3 replicas of 2 GPUs at $2: 3 x 2 x 2 x 730
    # = $8,760 a month. Mean load 6 req/s over a capacity of 15: 40 %. Tokens a month:
    # 6 req/s x 3600 x 730 x (500 + 200) = 11,037,600,000, so $8,760 / 11,037.6 M tokens
    # = $0.79365 per 1M.
    fleet = fixed_fleet_cost(_capacity(), TrafficProfile(6.0, 12.0), 2.0)
    assert (fleet.replicas, fleet.gpus_per_replica) == (3, 2)
    assert math.isclose(fleet.monthly_usd, 8760)
    assert math.isclose(fleet.utilization, 0.4)
    assert math.isclose(fleet.usd_per_1m_tokens, 0.793651, rel_tol=1e-6)


def test_traffic_profile():
    assert TrafficProfile.diurnal(2.0, 10.0).mean_request_rate == 6.0
    with pytest.raises(ParameterError) as err:
        TrafficProfile(10.0, 5.0)
    assert err.value.param == "peak_request_rate"


def test_the_tutorials_sizing_against_chapter_1():
    # params / 13: 5 GPUs for a 70B model whatever the GPU, and 64 attention heads do not
    # split 5 ways, so no engine can run it on 5 GPUs with tensor parallelism.
    assert tutorial_gpu_count(70, "fp16") == 5
    assert "must divide num_attention_heads (64)" in Deployment("Llama-3-70B", "H100 SXM",
                                                                5).problem()
    # And 5 x 24 GB RTX 4090 cannot hold 141 GB of BF16 weights; chapter 1 says so too.
    assert tutorial_gpu_count(70, "fp16") * 24 < 141
    # 7B: int(7 / 13) = 0 -> 1 GPU, for any GPU.
    assert tutorial_gpu_count(7, "fp16") == 1


def test_the_tutorials_dollars_per_million_are_multiplied_by_the_gpu_count():
    rows = {(r.gpu, r.precision): r for r in tutorial_compare_deployment(70, target_rps=20)}
    h100 = rows["H100-SXM", "fp16"]
    assert h100.num_gpus == 5 and h100.total_throughput_tok_s == 15_000
    # It divides the cost of all 5 GPUs by ONE GPU's throughput: 5 x 3.5 / 3600 / 3000 * 1e6
    # = $1.6204, five times the $0.32407 its own numbers give (3.5 / 3600 / 3000 * 1e6).
    assert math.isclose(h100.usd_per_1m_tokens, 1.620370, rel_tol=1e-6)
    assert math.isclose(h100.usd_per_1m_tokens / 5, 3.5 / 3600 / 3000 * 1e6)


def test_the_tutorials_plus_one_adds_a_gpu_when_the_division_is_exact():
    # 12 req/s x (500 + 500) tokens = 12,000 tok/s at 3,000 tok/s per H100: exactly 4,
    # and int(12000 / 3000) + 1 = 5.
    rows = {(r.gpu, r.precision): r for r in tutorial_compare_deployment(
        7, target_rps=12, avg_input_tokens=500, avg_output_tokens=500)}
    assert rows["H100-SXM", "fp16"].num_gpus == 5
    assert replicas_needed(12_000, 3_000) == 4


SLO = LatencySLO(1000, 50)
SMALL = Workload.fixed(256, 64, 60, seed=2)


def test_compare_deployments_ranks_runnable_rows_by_monthly_cost():
    options = compare_deployments("Llama-3-8B", SLO, SMALL, TrafficProfile(5.0, 20.0),
                                  gpus=["L40S", "A100 80GB"], weight_dtypes=["bf16", "fp8"],
                                  tensor_parallel_sizes=[1, 3], max_model_len=1024)
    assert len(options) == 8
    runnable = [o for o in options if o.problem is None]
    assert [o.deployment.label for o in runnable] and all(o.fleet for o in runnable)
    monthly = [o.fleet.monthly_usd for o in runnable]
    assert monthly == sorted(monthly)
    assert all(o.problem is not None for o in options[len(runnable):])
    problems = " ".join(o.problem for o in options if o.problem)
    assert "no fp8 tensor cores" in problems and "must divide" in problems
    for o in runnable:
        assert o.fleet.replicas == replicas_needed(20.0, o.capacity.max_request_rate)
        assert math.isclose(o.fleet.monthly_usd, o.fleet.replicas * o.deployment.num_gpus
                            * o.price.usd_per_gpu_hour * 730)
    table = comparison_table(options)
    assert "Llama-3-8B fp8 on 1 x L40S" in table and "no fp8 tensor cores" in table


def test_compare_with_a_price_table_that_lacks_the_gpu():
    quote = [GPUPrice("L40S", "my quote", "on_demand", 1.0, "quote", "2026-12-01")]
    options = compare_deployments("Llama-3-8B", SLO, SMALL, TrafficProfile(5.0, 10.0),
                                  gpus=["L40S", "A100 80GB"], tensor_parallel_sizes=[1],
                                  prices=quote, max_model_len=1024)
    by_gpu = {o.deployment.gpu: o for o in options}
    assert by_gpu["L40S"].price.provider == "my quote"
    assert "no on_demand price for A100 80GB" in by_gpu["A100 80GB"].problem


def test_autoscaled_fleet_bills_the_replica_hours_it_held():
    capacity = max_rate_at_slo(Deployment("Llama-3-8B", "L40S", max_model_len=1024), SLO, SMALL)
    trace = step_trace([(60, 0.5), (120, 1.5 * capacity.max_request_rate), (60, 0.5)],
                       input_len=256, output_len=64, seed=0)
    scaled = autoscaled_fleet_cost(capacity, trace, 1.0, cold_start_s=30.0)
    result = scaled.result
    assert max(r.index for r in result.replicas) >= 1  # it scaled up for the step
    assert math.isclose(scaled.mean_replicas, result.replica_seconds / result.end_s)
    assert math.isclose(scaled.monthly_usd, scaled.mean_replicas * 1 * 1.0 * 730)
    assert 0 <= scaled.ttft_slo_attainment <= 1
    infeasible = max_rate_at_slo(Deployment("Llama-3-8B", "L40S", max_model_len=1024),
                                 LatencySLO(1e-3, 1e-3), SMALL)
    with pytest.raises(ParameterError):
        autoscaled_fleet_cost(infeasible, trace, 1.0)


def test_a_fleet_is_replicas_of_the_deployment_chapter_6_prices():
    # One record for a replica: chapter 5's fleet takes the Deployment itself, and each of
    # its replicas gets the KV cache vLLM would allocate for it (chapter 1's plan) and vLLM's
    # scheduler defaults for the GPU (256 sequences, 2048 batched tokens on an L4).
    deployment = Deployment("Llama-3-8B", "L4", max_model_len=4096)
    fleet = FleetConfig(deployment, cold_start_s=30.0)
    scheduler = fleet.deployment.new_scheduler()
    plan = plan_kv_cache("Llama-3-8B", "L4", max_model_len=4096)
    assert scheduler.kv_cache.block_pool.num_blocks == plan.num_gpu_blocks
    assert (scheduler.config.max_num_seqs, scheduler.config.max_num_batched_tokens) == (256, 2048)
    assert FleetConfig().deployment == Deployment("Llama-3-8B", "L40S", max_model_len=8192)
    with pytest.raises(ParameterError) as err:
        FleetConfig(Deployment("Llama-3-70B", "L40S"))  # 140 GB of weights on 48 GB
    assert err.value.param == "deployment"
