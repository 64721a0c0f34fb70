"""The simulator, its workloads and vLLM's benchmark metrics."""

import json

import numpy as np
import pytest

from labkit.hardware import step_bound
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig, StaticBatchScheduler
from labkit.simulate import (RooflineCost, arrival_times, load_trace, multi_turn_workload,
                             random_workload, sample_lengths, simulate, summarize)


def one_second_per_step(rows):
    return 1.0


def test_two_requests_by_hand():
    # Both arrive at t=0 with 4-token prompts and 3 outputs; every step takes 1 s.
    # Step 1 prefills both (first tokens at t=1), steps 2 and 3 decode (t=2, t=3).
    reqs = [Request("a", [1, 2, 3, 4], [5, 6, 7]), Request("b", [8, 9, 10, 11], [5, 6, 7])]
    result = simulate(Scheduler(KVCacheManager(16, 4)), reqs, one_second_per_step)
    s = result.summary({"ttft": 1000, "tpot": 999})
    assert (s.mean_ttft_ms, s.mean_tpot_ms, s.mean_e2el_ms, s.mean_itl_ms) == (1000, 1000,
                                                                               3000, 1000)
    assert s.duration_s == 3 and s.output_throughput == 2 and s.request_throughput == 2 / 3
    assert s.request_goodput == 0                      # TPOT 1000 ms misses the 999 ms SLO
    assert [st.num_tokens for st in result.steps] == [8, 2, 2]
    assert "Mean TTFT (ms):" in s.table()


def test_arrivals_follow_rate_and_burstiness():
    gaps = np.diff(arrival_times(20000, request_rate=5.0, seed=1))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)    # Poisson: CV = 1
    bursty = np.diff(arrival_times(20000, 5.0, burstiness=0.25, seed=1))
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)  # CV = 1/sqrt(k)
    assert not arrival_times(3, float("inf")).any()


def test_lengths():
    assert (sample_lengths("fixed", 5, mean=64) == 64).all()
    u = sample_lengths("uniform", 1000, low=10, high=20)
    assert u.min() >= 10 and u.max() <= 20
    tail = sample_lengths("lognormal", 20000, mean=200, sigma=1.0, high=100_000)
    assert np.median(tail) == pytest.approx(200, rel=0.05) and tail.mean() > 1.5 * 200
    with pytest.raises(ValueError, match="kind must be"):
        sample_lengths("zipf", 3)


def test_multi_turn_prompts_carry_the_history():
    reqs = multi_turn_workload(2, turns=3, system_prompt_len=50, user_lens=[10],
                               output_lens=[5], conversation_rate=1.0, think_time_s=10)
    by_id = {r.request_id: r for r in reqs}
    t0, t1 = by_id["conv-0-turn-0"], by_id["conv-0-turn-1"]
    assert t1.prompt_token_ids[:65] == list(t0.prompt_token_ids) + list(t0.output_plan)
    assert by_id["conv-1-turn-0"].prompt_token_ids[:50] == t0.prompt_token_ids[:50]
    assert t1.arrival_time == t0.arrival_time + 10


def test_trace_replay(tmp_path):
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text("arrival_time,prompt_len,output_len\n0.0,12,3\n0.5,7,2\n")
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text("\n".join(json.dumps({"arrival_time": 1.5, "prompt_len": 4,
                                           "output_len": 1}) for _ in range(2)))
    reqs = load_trace(csv_path) + load_trace(jsonl)
    assert [(r.arrival_time, r.prompt_len, r.max_tokens) for r in reqs] == [
        (0.0, 12, 3), (0.5, 7, 2), (1.5, 4, 1), (1.5, 4, 1)]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt_len,output_len\n0,1,1\n")
    with pytest.raises(ValueError, match="every row needs 'arrival_time'"):
        load_trace(bad)


def test_roofline_cost_is_chapter_1s_bound():
    cost = RooflineCost("Llama-3-8B", "H100 SXM", step_overhead_s=0.002)
    rows = [(512, 0), (1, 300), (1, 900)]
    assert cost(rows) == pytest.approx(step_bound("Llama-3-8B", "H100 SXM", rows).time_s + 0.002)
    with pytest.raises(ValueError, match="unknown GPU"):
        RooflineCost("Llama-3-8B", "Z100")


def test_continuous_beats_static_on_the_same_workload():
    n = 200
    make = lambda: random_workload(  # noqa: E731 - a fresh copy for each scheduler
        n, 20.0, sample_lengths("lognormal", n, 1, mean=300, high=2000),
        sample_lengths("lognormal", n, 2, mean=100, high=800), seed=4)
    cost = RooflineCost("Llama-3-8B", "A100 80GB")
    blocks = 6000
    cont = simulate(Scheduler(KVCacheManager(blocks, 16), SchedulerConfig(64, 2048)), make(),
                    cost).summary()
    static = simulate(StaticBatchScheduler(KVCacheManager(blocks, 16), 64), make(), cost).summary()
    assert cont.completed == static.completed == n
    assert cont.output_throughput > 1.5 * static.output_throughput
    assert cont.median_ttft_ms < static.median_ttft_ms


def test_summary_errors():
    r = Request("a", [1], [2])
    with pytest.raises(ValueError, match="no request finished"):
        summarize([r], 1.0)
    with pytest.raises(ValueError, match="SLO metric must be one of"):
        summarize([r], 1.0, {"latency": 5})
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_times(3, 0)
