"""Chapter 6 cost exercise checks: right answers pass, the tutorial's mistakes are named, and
the expected values are the ones worked out by hand."""

from dataclasses import replace

import pytest

from labkit.cost.capacity import LatencySLO
from labkit.simulate import Workload
from labkit.cost.compare import TrafficProfile, compare_deployments
from labkit.cost.tokens import Throughput
from labkit.exercises import ch06_cost as ex


def test_cost_per_million():
    # 4 GPUs x $2 = $8/h = $0.0022222/s; / (0.6 x 12,000 tok/s) x 1e6 = $0.30864 per 1M.
    assert ex.check_cost_per_million(0.30864)
    assert "ignore utilization" in repr(ex.check_cost_per_million(0.185185))   # x 0.6
    assert "multiply by utilization" in repr(ex.check_cost_per_million(0.111111))  # x 0.36
    assert "one GPU" in repr(ex.check_cost_per_million(0.07716))               # / 4
    assert "all the GPUs" in repr(ex.check_cost_per_million(1.23457))          # x 4
    assert "1000" in repr(ex.check_cost_per_million(0.30864 / 1000))
    assert "Not answered" in repr(ex.check_cost_per_million(None))
    # Other numbers: 1 GPU at $3.6/h, 1,000 tok/s, fully used: $1 per 1M.
    assert ex.check_cost_per_million(1.0, 3.6, 1, 1000.0, 1.0)


def test_monthly_cost():
    # 3 replicas x 2 GPUs x $2.5 x 730 h = $10,950.
    assert ex.check_monthly_cost(10_950)
    assert "utilization" in repr(ex.check_monthly_cost(6_570))          # x 0.6
    assert "24 x 30" in repr(ex.check_monthly_cost(10_800))             # 720 h
    assert "GPUs" in repr(ex.check_monthly_cost(5_475))                 # one GPU per replica


def test_replicas():
    # ceil(45 / 12) = ceil(3.75) = 4.
    assert ex.check_replicas(4)
    assert "round down" in repr(ex.check_replicas(3))
    assert "mean" in repr(ex.check_replicas(2))                         # ceil(20 / 12)
    assert ex.check_replicas(5, peak_request_rate=48.1, max_request_rate=12.0)


def test_input_output_prices():
    # $3.6/h on 1 GPU = $0.001/s. Prefill 30 % of it over 1,000 input tok/s: $0.3 per 1M;
    # decode 70 % over 100 output tok/s: $7 per 1M; blended $0.001 / 1,100 x 1e6 = $0.909.
    throughput = Throughput(1000.0, 100.0, 2.0, 0.3, 1, "the test")
    assert ex.check_input_output_prices((0.3, 7.0), throughput, 3.6)
    alike = repr(ex.check_input_output_prices((0.909091, 0.909091), throughput, 3.6))
    assert "alike" in alike
    # Swapped: 70 % over the input, 30 % over the output: $0.7 and $3.
    assert "swap" in repr(ex.check_input_output_prices((0.7, 3.0), throughput, 3.6))
    assert not ex.check_input_output_prices(0.3, throughput, 3.6)
    assert "Not answered" in repr(ex.check_input_output_prices(None, throughput, 3.6))


@pytest.fixture(scope="module")
def options():
    return compare_deployments("Llama-3-8B", LatencySLO(1000, 50), Workload.fixed(256, 64, 60),
                               TrafficProfile(3.0, 12.0), gpus=["L4", "L40S", "A100 80GB"],
                               tensor_parallel_sizes=[1], max_model_len=1024)


def test_cheapest_deployment(options):
    runnable = [o for o in options if o.problem is None]
    cheapest = runnable[0].fleet.monthly_usd
    for o in runnable:
        assert bool(ex.check_cheapest_deployment(o.deployment.label, options)) == (
            o.fleet.monthly_usd == cheapest)
    assert "not one of" in repr(ex.check_cheapest_deployment("Llama on a toaster", options))
    assert "Not answered" in repr(ex.check_cheapest_deployment(None, options))


def test_cheapest_deployment_accepts_ties():
    options = compare_deployments("Llama-3-8B", LatencySLO(1000, 50),
                                  Workload.fixed(256, 64, 60), TrafficProfile(3.0, 12.0),
                                  gpus=["L40S"], tensor_parallel_sizes=[1],
                                  max_model_len=1024)
    one = options[0]
    twin = replace(one, deployment=replace(one.deployment, tensor_parallel_size=2))
    feedback = ex.check_cheapest_deployment(twin.deployment.label, [one, twin])
    assert feedback and "tied with Llama-3-8B bf16 on 1 x L40S" in repr(feedback)
