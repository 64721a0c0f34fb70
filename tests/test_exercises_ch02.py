"""Chapter 2 exercise checks and the engine tables."""

from labkit.engine import SamplingParams
from labkit.exercises import ch02 as ex
from labkit.launch import ServeConfig
from labkit.harness.lab_engines import engine_table_markdown, flag_table_markdown

METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m"} 300.0
"""


def test_stop_params():
    assert ex.check_stop_params(SamplingParams(temperature=0, max_tokens=20, stop=["."]))
    feedback = repr(ex.check_stop_params(SamplingParams(max_tokens=16)))
    assert 'stop should contain "."' in feedback and "max_tokens should be 20" in feedback
    assert not ex.check_stop_params(None)


def test_chat_body():
    good = {"model": "m", "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    assert ex.check_chat_body(good, "m")
    assert "stream should be True" in repr(ex.check_chat_body({**good, "stream": False}, "m"))
    assert "messages should be" in repr(ex.check_chat_body({**good, "messages": "hi"}, "m"))


def test_prefix_hit_rate_from_a_scrape():
    assert ex.check_prefix_hit_rate(0.75, METRICS)
    assert "percentage" in repr(ex.check_prefix_hit_rate(75, METRICS))
    assert "send requests first" in repr(ex.check_prefix_hit_rate(0.5, ""))


def test_tpot_and_goodput_by_hand():
    # TTFT 300 ms, E2EL 450 ms, 4 tokens: TPOT = 150 / 3 = 50 ms.
    assert ex.check_tpot_ms(50, 10.0, [10.30, 10.34, 10.40, 10.45])
    assert "first token" in repr(ex.check_tpot_ms(112.5, 10.0, [10.30, 10.34, 10.40, 10.45]))
    # Requests 1 and 2 meet both SLOs (3 misses TPOT, 4 misses TTFT, 5 is fine): 3 / 2 s.
    args = ([120, 480, 90, 700, 300], [40, 35, 80, 30, 45], 2.0, 500, 50)
    assert ex.check_goodput(1.5, *args)
    assert "TTFT SLO only" in repr(ex.check_goodput(2.0, *args))


def test_engine_tables_render_every_engine():
    table = engine_table_markdown()
    assert table.splitlines()[0].count("|") == 6 and "TensorRT-LLM" in table
    flags = flag_table_markdown(ServeConfig(model="m", tensor_parallel_size=2, max_model_len=4096))
    assert "`--tp-size 2`" in flags and "`--max_seq_len 4096`" in flags


def test_kv_bytes_per_token_names_the_mistake():
    # Llama-3-70B: 80 layers x (K, V) x 8 KV heads x 128 head_dim x 2 bytes = 327,680 bytes.
    assert ex.check_kv_bytes_per_token(327_680, "Llama-3-70B", "bf16")
    assert "attention heads" in repr(ex.check_kv_bytes_per_token(327_680 * 8, "Llama-3-70B"))
    assert "K or V" in repr(ex.check_kv_bytes_per_token(163_840, "Llama-3-70B"))
    assert "layers" in repr(ex.check_kv_bytes_per_token(4_096, "Llama-3-70B"))
    assert "fp32" in repr(ex.check_kv_bytes_per_token(655_360, "Llama-3-70B"))
    assert not ex.check_kv_bytes_per_token(None, "Llama-3-70B")


def test_speedup_from_two_benchmark_results():
    from dataclasses import replace

    from labkit.simulate.metrics import summarize_latencies
    from labkit.simulate.metrics import RequestLatencies

    one = summarize_latencies([RequestLatencies.from_times("a", 4, 0.0, [0.1, 0.2, 0.3])], 1.0)
    fast = replace(one, output_throughput=300.0)
    slow = replace(one, output_throughput=100.0)
    assert ex.check_speedup(3.0, fast, slow)
    assert "other way round" in repr(ex.check_speedup(1 / 3, fast, slow))
    assert "percent" in repr(ex.check_speedup(200, fast, slow))


def test_time_regex():
    assert ex.check_time_regex(r"([01][0-9]|2[0-3]):[0-5][0-9]")
    loose = repr(ex.check_time_regex(r"[0-9]{2}:[0-9]{2}"))
    assert "accepts '24:00'" in loose and "'12:60'" in loose
    assert "refuses '00:00'" in repr(ex.check_time_regex(r"(1[0-9]|2[0-3]):[0-5][0-9]"))
    assert "does not compile" in repr(ex.check_time_regex("(["))
    assert "Not answered" in repr(ex.check_time_regex(None))
    assert "must be a string" in repr(ex.check_time_regex(12))


def test_trtllm_kv_fraction():
    # vLLM's 0.9 of 80 GiB with 15 GiB of weights leaves 72 - 15 = 57 GiB for the cache;
    # TensorRT-LLM sees 80 - 15 = 65 GiB free: 57 / 65 = 0.8769.
    assert ex.check_trtllm_kv_fraction(57 / 65)
    assert "copied vLLM's fraction" in repr(ex.check_trtllm_kv_fraction(0.9))
    assert "whole GPU" in repr(ex.check_trtllm_kv_fraction(57 / 80))
