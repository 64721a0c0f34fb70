"""The book's figures (labkit.figures) draw what the data structures and runs hold."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from labkit.autoscale import WAITING, HorizontalPodAutoscaler
from labkit.checks import ParameterError
from labkit.figures.autoscale import hpa_loop_figure, run_hpa
from labkit.figures.batching import (DECODE, NOT_ARRIVED, PADDING, PREEMPTED, PREFILL,
                                     batching_figure, compare_batching)
from labkit.figures.batching import WAITING as WAIT
from labkit.figures.gateway import (DROPPED, KEPT, endpoint_picker_example, routing_figure,
                                    trace_routing)
from labkit.figures.kvcache import block_table_figure, shared_prefix_example
from labkit.figures.parallel import (ring_all_reduce_figure, ring_all_reduce_steps,
                                     tensor_parallel_mlp_figure)
from labkit.figures.roofline import prefill_decode_roofline
from labkit.figures.speculation import speedup_figure, tokens_per_step_figure
from labkit.gateway.endpoints import Endpoint, RoutingRequest, SaturatedError
from labkit.gateway.routing import make_router
from labkit.kvcache import KVCacheManager
from labkit.parallel import ring_all_reduce_bytes
from labkit.scheduling import continuous_decode_steps, static_decode_steps
from labkit.simulate.speculation import speculative_decode_gain


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _by_gid(fig, prefix):
    """{gid: artist} for every artist of ``fig`` whose gid starts with ``prefix``."""
    return {a.get_gid(): a for a in fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))}


# --- chapter 3.1: the block table ---------------------------------------------------------

def test_block_table_draws_exactly_the_managers_tables():
    kv = shared_prefix_example()
    # Derived by hand from the allocation order: the free queue starts 0..11. D takes 0, 1
    # and frees them tail first, so the queue becomes 2..11, 1, 0. A's 40 tokens take 2, 3, 4;
    # B's 20 take 5, 6; C hits A's two system-prompt blocks 2, 3 and takes 7 for its last 13
    # tokens; A's decode to 50 tokens needs a fourth block: 8.
    expected = {"A": [2, 3, 4, 8], "B": [5, 6], "C": [2, 3, 7]}
    assert {rid: kv.get_block_ids(rid) for rid in kv.req_to_blocks} == expected
    fig = block_table_figure(kv)
    drawn = {gid: int(text.get_text()) for gid, text in _by_gid(fig, "logical:").items()}
    assert drawn == {f"logical:{rid}:{i}": block for rid, table in expected.items()
                     for i, block in enumerate(table)}
    refs = {gid.split(":")[1]: text.get_text() for gid, text in _by_gid(fig, "ref:").items()}
    assert refs["2"] == refs["3"] == "ref 2"          # the shared system prompt
    assert refs["4"] == refs["7"] == refs["8"] == "ref 1"
    assert refs["0"] == refs["1"] == refs["11"] == "ref 0"
    assert len(_by_gid(fig, "physical:")) == kv.num_blocks
    cached_free = _by_gid(fig, "physical:0")["physical:0"].get_facecolor()
    empty_free = _by_gid(fig, "physical:1")["physical:1"].get_facecolor()
    assert cached_free != empty_free and empty_free[:3] == (1.0, 1.0, 1.0)  # D's full block


def test_block_table_without_prefix_caching_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    for rid in ("x", "y"):
        kv.allocate_slots(rid, [1, 2, 3, 4, 5], 5)      # the same tokens, 2 blocks each
    fig = block_table_figure(kv, ["y"])
    assert {t.get_text() for t in _by_gid(fig, "logical:").values()} == {"2", "3"}
    assert {t.get_text() for t in _by_gid(fig, "ref:").values()} == {"ref 1", "ref 0"}


def test_block_table_refuses_unknown_requests_and_huge_pools():
    with pytest.raises(ValueError, match="unknown request"):
        block_table_figure(shared_prefix_example(), ["Z"])
    with pytest.raises(ParameterError, match="kv"):
        block_table_figure(KVCacheManager(num_blocks=100, block_size=16))


# --- chapter 3.2: the batching timeline -----------------------------------------------------

def test_one_token_prompts_reproduce_the_tutorials_step_counts():
    # With 1-token prompts each step yields one token per sequence, as in the tutorial's toy;
    # the chapter prints its counts for these ten outputs: 200 static, 100 continuous.
    outputs = [10, 50, 5, 100, 3, 20, 8, 60, 15, 40]
    static, continuous = compare_batching([1] * 10, outputs, [0] * 10,
                                          max_num_batched_tokens=2048)
    assert static.num_steps == static_decode_steps(outputs, 4) == 200
    assert continuous.num_steps == continuous_decode_steps(outputs, 4) == 100
    # The 1-token prompt is a prefill step that yields the first token; the rest are decodes.
    for timeline in (static, continuous):
        assert [(s.count(PREFILL), s.count(DECODE)) for s in timeline.states] == \
            [(1, n - 1) for n in outputs]
    # Static batching carries finished requests as padding; continuous batching never does.
    assert static.count(PADDING) > 0 and continuous.count(PADDING) == 0


def test_timeline_states_follow_the_schedulers_rules():
    prompts, outputs = [40, 100, 24, 60, 16], [6, 12, 3, 9, 4]
    arrivals = [0, 0, 0, 3, 5]
    static, continuous = compare_batching(prompts, outputs, arrivals, max_num_seqs=2,
                                          max_num_batched_tokens=64)
    for timeline in (static, continuous):
        for states, output_len, arrival in zip(timeline.states, outputs, arrivals, strict=True):
            # The prompt's last step yields the first token; each decode step one more.
            assert states.count(DECODE) == output_len - 1
            assert all(s == NOT_ARRIVED for s in states[:arrival])
            first_decode = states.index(DECODE)
            assert PREFILL not in states[first_decode:]
        for step in range(timeline.num_steps):
            running = [s[step] for s in timeline.states if s[step] in (PREFILL, DECODE)]
            assert len(running) <= 2                                  # max_num_seqs
    # Chunked prefill: 100 prompt tokens under a 64-token budget take at least two steps.
    assert continuous.states[1].count(PREFILL) >= 2
    assert all(n <= 64 for n in continuous.num_tokens)
    # Static batching prefills a whole batch in one step, and nobody joins a running batch:
    # r0 and r1 run 1 prefill step + 11 decode steps (r1's 12 tokens), so r2 starts at 12.
    assert static.states[1].count(PREFILL) == 1
    assert static.states[2].index(PREFILL) == 12


def test_preemption_shows_in_the_timeline():
    # 6 blocks of 4 tokens hold 24 tokens; two requests of 8 + 12 tokens need 5 blocks each
    # at the end, 10 together: the later one must be preempted and recomputed.
    timelines = compare_batching([8, 8], [12, 12], [0, 0], max_num_seqs=2,
                                 max_num_batched_tokens=64, block_size=4, num_blocks=6)
    continuous = timelines[1]
    assert continuous.count(PREEMPTED) >= 1
    # A preempted request recomputes its prompt and outputs in one prefill step (20 tokens fit
    # the budget), and that step yields the token a decode step would have.
    assert [s.count(DECODE) + s.count(PREEMPTED) for s in continuous.states] == [11, 11]
    fig = batching_figure(timelines)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert PREEMPTED in labels and WAIT in labels


def test_batching_figure_draws_every_cell_once():
    timelines = compare_batching([40, 100, 24], [6, 12, 3], [0, 0, 2], max_num_seqs=2)
    fig = batching_figure(timelines)
    for ax, timeline in zip(fig.axes, timelines, strict=True):
        for rid, states in zip(timeline.request_ids, timeline.states, strict=True):
            for state in (WAIT, PREFILL, DECODE, PADDING):
                bars = [c for c in ax.collections if c.get_gid() == f"{rid}:{state}"]
                drawn = sum(p.get_extents().width for c in bars for p in c.get_paths())
                assert drawn == states.count(state)
        assert f"{timeline.num_steps} steps" in ax.get_title(loc="left")


# --- chapter 1.4: prefill and decode on the roofline --------------------------------------

def test_roofline_places_decode_and_prefill_where_the_datasheet_says():
    fig = prefill_decode_roofline("Llama-3-8B", "H100 SXM", prompt_len=2048,
                                  context_lens=(1024, 4096))
    ax = fig.axes[0]
    lines = {line.get_gid(): line for line in ax.lines if line.get_gid()}
    short, long = lines["decode:1024"], lines["decode:4096"]
    x, y = np.asarray(short.get_xdata()), np.asarray(short.get_ydata())
    # Batch 1 reads each of ~8.0e9 BF16 weights (2 bytes) for 2 FLOPs: 1 FLOP/byte, give or
    # take the KV cache (+1 % bytes) and attention over 1,024 tokens (+3 % FLOPs).
    assert 0.95 < x[0] < 1.1
    assert np.all(np.diff(x) > 0)                       # batching raises the intensity
    ridge = 989 / 3.35                                  # H100 SXM: 989 TFLOP/s, 3.35 TB/s
    assert x[-1] < ridge                                # still memory-bound at batch 256
    # Memory-bound points sit on the slanted roof: TFLOP/s = intensity x 3.35 TB/s.
    np.testing.assert_allclose(y, x * 3.35, rtol=1e-9)
    assert len(x) == 9                                  # batch 1..256 all fit at 1,024
    # At 4,096 tokens each sequence holds 512 MiB of KV; vLLM's budget on 80 GiB after
    # ~15 GiB of weights is ~55 GiB: batch 64 (32 GiB) fits, batch 128 (64 GiB) does not.
    assert len(long.get_xdata()) == 7
    (prefill,) = ax.collections
    assert prefill.get_offsets()[0][0] > ridge          # prefill is compute-bound


# --- chapter 3.4: the tensor-parallel MLP and the ring all-reduce ---------------------------

def test_mlp_split_is_labelled_with_the_models_shapes():
    # Llama-3-8B's config.json: hidden_size 4096, intermediate_size 14336; 14336 / 4 = 3584.
    fig = tensor_parallel_mlp_figure("Llama-3-8B", 4)
    lanes = {gid: t.get_text() for gid, t in _by_gid(fig, "lane:").items()}
    assert len(lanes) == 4 * 5
    assert lanes["lane:3:1"].endswith("[4,096 × 3,584]")
    assert lanes["lane:0:3"].endswith("[3,584 × 4,096]")
    assert "[4,096 × 14,336]" in _by_gid(fig, "full:gate_up")["full:gate_up"].get_text()
    assert "4 GPUs" in _by_gid(fig, "all-reduce")["all-reduce"].get_text()
    two = _by_gid(tensor_parallel_mlp_figure("Llama-3-8B", 2), "lane:")
    assert len(two) == 2 * 5 and two["lane:1:1"].get_text().endswith("[4,096 × 7,168]")
    with pytest.raises(ParameterError, match="tensor_parallel_size"):
        tensor_parallel_mlp_figure("Llama-3-8B", 3)      # 14336 is not a multiple of 3


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_schedule_is_an_all_reduce(p):
    steps = ring_all_reduce_steps(p)
    assert len(steps) - 1 == 2 * (p - 1)                # 2 (p - 1) steps after the start
    # After reduce-scatter, rank r owns chunk r + 1 (mod p) fully reduced and no other:
    # the standard ring result (Patarasuk and Yuan, 2009; NCCL's ring).
    after_rs = steps[p - 1]
    assert after_rs.phase == "reduce-scatter" and after_rs.index == p - 1
    assert [after_rs.complete(r) for r in range(p)] == [[(r + 1) % p] for r in range(p)]
    assert all(step.complete(r) == list(range(p)) for step in steps[-1:] for r in range(p))
    # Apply the schedule to real numbers: every rank ends with the sum of all ranks' buffers.
    rng = np.random.default_rng(p)
    data = rng.normal(size=(p, p, 3))                   # rank, chunk, values
    buffers = data.copy()
    for step in steps[1:]:
        assert sorted(src for src, _, _ in step.sends) == list(range(p))   # one send each
        assert sorted(dst for _, dst, _ in step.sends) == list(range(p))   # one receive each
        messages = [(dst, chunk, buffers[src, chunk].copy()) for src, dst, chunk in step.sends]
        for dst, chunk, values in messages:
            if step.phase == "reduce-scatter":
                buffers[dst, chunk] += values
            else:
                buffers[dst, chunk] = values
    np.testing.assert_allclose(buffers, np.broadcast_to(data.sum(axis=0), data.shape))
    # What each rank sends, 2 (p - 1) chunks of 1/p, is what chapter 3.4's cost model charges.
    chunks_sent = sum(1 for step in steps[1:] for src, _, _ in step.sends if src == 0)
    assert chunks_sent / p * 1e6 == pytest.approx(ring_all_reduce_bytes(1e6, p))


def test_ring_figure_marks_what_each_step_received():
    fig = ring_all_reduce_figure(4)
    chunks = _by_gid(fig, "chunk:")
    assert len(chunks) == 7 * 4 * 4                     # 7 rows, 4 ranks, 4 chunks each
    red = [gid for gid, patch in chunks.items() if patch.get_linewidth() == 2.0]
    assert len(red) == 6 * 4                            # one received chunk per rank per step
    assert "chunk:3:0:1" in red                         # step 3: rank 0 completes chunk 1
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels.count("Σ") == sum(len(s.complete(r)) for s in ring_all_reduce_steps(4)
                                    for r in range(4))


# --- chapter 5.2: filter, score, pick --------------------------------------------------------

def test_routing_trace_matches_the_pipeline_and_the_worked_example():
    pipeline, request, endpoints, now = endpoint_picker_example()
    trace = trace_routing(pipeline, request, endpoints, now)
    assert trace.stage_names == ("routable", "saturation-detector", "queue-scorer",
                                 "kv-cache-utilization-scorer", "prefix-cache-scorer",
                                 "max-score-picker")
    assert trace.filters[0] == (KEPT, KEPT, KEPT, DROPPED, KEPT)     # d is ejected
    assert trace.filters[1] == (KEPT, KEPT, KEPT, "", DROPPED)       # e: KV 86 % >= 80 %
    # Chapter 5.2's hand-worked totals: a = 2 x 1 + 2 x 0.7 = 3.4; c = 2 x 2/3 + 2 x 0.21.
    assert trace.totals[0] == pytest.approx(3.4)
    assert trace.totals[2] == pytest.approx(2 * 2 / 3 + 2 * 0.21)
    # b holds the earlier turn: the prompt is cut into ceil(1147 / 64) = 18 chunks of 64
    # characters; the first 17 (1,088 characters) lie inside the 1,114 shared ones.
    assert trace.scores[2][1] == pytest.approx(17 / 18)
    assert trace.totals[1] == pytest.approx(0 + 2 * 0.45 + 3 * 17 / 18)
    assert trace.picked is endpoints[1]
    scored = {e.url: total for e, total in pipeline.scored(request, endpoints, now)}
    assert scored == {e.url: t for e, t in zip(endpoints, trace.totals, strict=True)
                      if t is not None}


def test_routing_figure_shows_the_stages_and_the_pick():
    pipeline, request, endpoints, now = endpoint_picker_example()
    fig = routing_figure(trace_routing(pipeline, request, endpoints, now), now)
    headers = [gid.removeprefix("header:") for gid in _by_gid(fig, "header:")]
    assert headers == ["endpoint (scraped metrics)", "routable", "saturation-detector",
                       "queue-scorer\n× 2", "kv-cache-utilization-scorer\n× 2",
                       "prefix-cache-scorer\n× 3", "total", "max-score-picker"]
    assert list(_by_gid(fig, "picked:")) == ["picked:1"]
    assert _by_gid(fig, "total:0")["total:0"].get_text() == "3.40"
    assert "total:3" not in _by_gid(fig, "total:")                  # dropped: no score


def test_round_robin_trace_and_load_shedding():
    endpoints = [Endpoint(f"http://{n}") for n in "xyz"]
    rr = make_router("round_robin")
    trace = trace_routing(rr, RoutingRequest(None, "hi"), endpoints, 0.0)
    assert trace.scores == () and trace.totals == (0.0, 0.0, 0.0)
    assert trace.picked is endpoints[0]                  # nobody picked yet: list order
    full = [Endpoint("http://f", num_requests_waiting=9, kv_cache_usage=0.1, metrics_time=0.0)]
    with pytest.raises(SaturatedError):
        trace_routing(make_router("endpoint_picker"), RoutingRequest(None, "hi"), full, 0.0)


# --- chapter 5.6: the HPA loop ---------------------------------------------------------------

SYNCS = [(0, [5, 6]), (15, [9, 13]), (30, [4, 4, 5, 3]), (45, [1, 0, 1, 0]),
         (330, [0, 1, 0, 0]), (360, [0, 0])]


def test_hpa_loop_shows_the_formula_with_the_syncs_numbers():
    hpa = HorizontalPodAutoscaler(WAITING, target=5, min_replicas=1, max_replicas=10)
    observations = run_hpa(hpa, SYNCS, replicas=2)
    # Chapter 5.6, by hand: 2 replicas wait 9 and 13, mean 11: ceil(2 x 11 / 5) = 5; the
    # 300 s window holds 5 until the busy proposals age out at 330 s.
    assert [d.desired for d in hpa.decisions] == [2, 5, 5, 5, 1, 1]
    fig = hpa_loop_figure(hpa, observations)
    boxes = {gid.removeprefix("box:"): t.get_text() for gid, t in _by_gid(fig, "box:").items()}
    assert "mean 11 over 2 of 2 pods" in boxes["observe"]
    assert "⌈2 × 11 / 5⌉ = 5" in boxes["propose"]
    assert "highest of last 300 s" in boxes["stabilize"]
    # Kubernetes' default behaviour: up by 4 pods or 100 % per 15 s, whichever allows more.
    assert "4 pods / 15 s or 100 % / 15 s" in boxes["limit rate"].replace("\n", " ")
    assert "2 → 5" in boxes["scale"]
    (spec_line,) = [line for line in fig.axes[1].lines if "spec" in line.get_label()]
    assert list(spec_line.get_ydata()) == [2, 5, 5, 5, 1, 1]


def test_hpa_loop_within_tolerance_and_bad_input():
    hpa = HorizontalPodAutoscaler(WAITING, target=5, min_replicas=1, max_replicas=10)
    observations = run_hpa(hpa, SYNCS, replicas=2)
    fig = hpa_loop_figure(hpa, observations, highlight=0)
    # Mean 5.5 against 5 is a ratio of 1.1: inside the default 10 % tolerance.
    text = _by_gid(fig, "box:propose")["box:propose"].get_text()
    assert "1.10" in text and "keep 2" in text
    with pytest.raises(ParameterError, match="observations"):
        hpa_loop_figure(hpa, observations[:-1])
    with pytest.raises(ParameterError, match="highlight"):
        hpa_loop_figure(hpa, observations, highlight=6)


# --- chapter 2.1: the engine loop -------------------------------------------------------------

def test_engine_loop_is_labelled_from_the_engine(tmp_path):
    from labkit.engine import LLM, write_tiny_model
    from labkit.figures.engine import engine_loop_figure

    llm = LLM(model=str(write_tiny_model(tmp_path / "tiny")), max_num_seqs=16,
              max_num_batched_tokens=256, block_size=8)
    engine = llm.llm_engine
    boxes = {gid.removeprefix("box:"): t.get_text()
             for gid, t in _by_gid(engine_loop_figure(engine), "box:").items()}
    assert list(boxes) == ["tokenizer", "scheduler", "KV cache manager", "model runner",
                           "sampler"]
    assert "512-token vocabulary" in boxes["tokenizer"]   # write_tiny_model's vocab_size
    assert "max_num_seqs 16" in boxes["scheduler"]
    assert "max_num_batched_tokens 256" in boxes["scheduler"]
    assert f"{engine.num_gpu_blocks:,} blocks of 8 tokens" in boxes["KV cache manager"]
    assert "2 layers, hidden 128" in boxes["model runner"]  # write_tiny_model's shape


def _line(fig, gid, ax_index=0):
    return next(line for line in fig.axes[ax_index].get_lines() if line.get_gid() == gid)


def test_tokens_per_step_curves_run_from_one_to_k_plus_one_through_the_measured_points():
    fig = tokens_per_step_figure((1, 4), measured={"vLLM CPU, repetitive": (0.9, 3.7)})
    for k in (1, 4):
        y = _line(fig, f"k:{k}").get_ydata()
        assert y[0] == pytest.approx(1) and y[-1] == pytest.approx(k + 1)
    # a = 0.5, k = 4 (the middle of 101 points): 1 + 0.5 + 0.25 + 0.125 + 0.0625 = 1.9375.
    assert _line(fig, "k:4").get_ydata()[50] == pytest.approx(1.9375)
    point = _line(fig, "vLLM CPU, repetitive")
    assert (point.get_xdata()[0], point.get_ydata()[0]) == (0.9, 3.7)
    with pytest.raises(ParameterError):
        tokens_per_step_figure((0,))


def test_speedup_figure_puts_the_measurement_beside_the_rooflines_prediction():
    fig = speedup_figure({"repetitive": [(4, 1.4), (1, 0.9)]}, "vLLM CPU", 0.7, 4,
                         context_lens=(256, 4096), batch_sizes=(1, 1024))
    measured = _line(fig, "measured:repetitive")
    assert list(measured.get_xdata()) == [1, 4] and list(measured.get_ydata()) == [0.9, 1.4]
    predicted = _line(fig, "predicted:256", ax_index=1)
    expected = [speculative_decode_gain("Llama-3-8B", "H100 SXM", b, 256, 4, 0.7).speedup
                for b in (1, 1024)]
    assert list(predicted.get_ydata()) == pytest.approx(expected)
    assert expected[0] > 2 > 1 > expected[1]   # memory-bound at 1, compute-bound at 1024
    # 1,024 sequences of 4,100 tokens at 128 KiB a token (Llama-3-8B, bf16) are 513 GiB of
    # KV cache: far past an H100's 80 GB, so that line keeps only batch 1.
    assert list(_line(fig, "predicted:4096", ax_index=1).get_xdata()) == [1]
    with pytest.raises(ParameterError) as err:
        speedup_figure({}, "x", 0.7, 4)
    assert err.value.param == "measured"
