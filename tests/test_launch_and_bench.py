"""Launch commands, the server process manager, and the benchmark harness end to end."""

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.bench import benchmark, request_latencies, server_tokenizer
from labkit.simulate import random_dataset, shared_prefix_dataset
from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.engine.args import parse_engine_args
from labkit.engine.speculative import SpeculativeConfig
from labkit.engine.tokenizer import Tokenizer
from labkit.lab import ENGINE_PACKAGES
from labkit.launch import (COMMANDS, ServeConfig, command_for, labkit_command,
                           multi_node_commands, sglang_command, trtllm_build_commands,
                           trtllm_command, trtllm_kv_fraction, vllm_command)
from labkit.process import (ServerProcess, free_port, group_alive, kill_group, signal_group,
                            wait_until, wait_until_async)

CFG = ServeConfig(model="meta-llama/Meta-Llama-3-70B-Instruct", served_model_name="llama-70b",
                  tensor_parallel_size=4, gpu_memory_utilization=0.9, max_model_len=8192,
                  quantization="awq", port=8000)


def flag(command, name):
    return command[command.index(name) + 1]


def test_vllm_command_carries_the_tutorials_options():
    cmd = vllm_command(CFG)
    assert cmd[:3] == ["vllm", "serve", CFG.model]
    assert (flag(cmd, "--tensor-parallel-size"), flag(cmd, "--gpu-memory-utilization"),
            flag(cmd, "--max-model-len"), flag(cmd, "--quantization"),
            flag(cmd, "--served-model-name")) == ("4", "0.9", "8192", "awq", "llama-70b")
    assert flag(cmd, "--host") == "127.0.0.1"           # safe default: localhost only
    assert "--trust-remote-code" not in cmd


def test_sglang_and_trtllm_name_the_same_options_their_way():
    sg = sglang_command(CFG)
    assert (flag(sg, "--model-path"), flag(sg, "--tp-size"), flag(sg, "--mem-fraction-static"),
            flag(sg, "--context-length")) == (CFG.model, "4", "0.9", "8192")
    trt = trtllm_command(CFG)
    assert trt[:2] == ["trtllm-serve", CFG.model] and flag(trt, "--tp_size") == "4"
    # vLLM's fraction of the whole GPU is not TensorRT-LLM's fraction of what is free.
    assert "--kv_cache_free_gpu_memory_fraction" not in trt
    trt = trtllm_command(CFG, kv_cache_free_gpu_memory_fraction=0.87)
    assert flag(trt, "--kv_cache_free_gpu_memory_fraction") == "0.87"
    convert, build = trtllm_build_commands(CFG, "ckpt", "engine")
    assert flag(convert, "--tp_size") == "4" and flag(build, "--max_seq_len") == "8192"


def test_bad_configs():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ServeConfig(model="m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive"):
        ServeConfig(model="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"port must be in \[1, 65535\]"):
        ServeConfig(model="m", port=70000)
    with pytest.raises(ParameterError, match="engine must be one of") as err:
        command_for("ollama", ServeConfig(model="m"))
    assert err.value.param == "engine"
    with pytest.raises(ParameterError, match="one device, unquantized") as err:
        labkit_command(CFG)
    assert err.value.param == "tensor_parallel_size"
    with pytest.raises(ParameterError, match="quantization must be None") as err:
        labkit_command(ServeConfig(model="m", quantization="awq"))
    assert err.value.param == "quantization"
    with pytest.raises(ParameterError, match="model must be a model name") as err:
        ServeConfig(model="")
    assert err.value.param == "model"
    with pytest.raises(ParameterError, match="backend must be 'pytorch' or 'tensorrt'") as err:
        trtllm_command(CFG, backend="onnx")
    assert err.value.param == "backend"


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_speculative_config_is_vllms_json_for_vllm_and_the_teaching_engine():
    cfg = ServeConfig(model="m", speculative_config=NGRAM)
    for command in (vllm_command(cfg), labkit_command(cfg)):
        assert json.loads(flag(command, "--speculative-config")) == NGRAM
    # labkit serve reads it back with vLLM's defaulting: the missing minimum takes the maximum.
    args = parse_engine_args(labkit_command(cfg)[4:])
    assert args.speculative_config == SpeculativeConfig(4, "ngram", 3, 3)
    assert "--speculative-config" not in vllm_command(ServeConfig(model="m"))


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1, got 0"),
    ({"num_speculative_tokens": True}, "integer >= 1, got True"),
    ({"num_speculative_tokens": 2.5}, "integer >= 1, got 2.5"),
    ({"num_speculative_tokens": 2, "acceptance": float("nan")}, "must be JSON"),
    ({"num_speculative_tokens": 2, "model": object()}, "must be JSON"),
    ('{"num_speculative_tokens": 2}', "must be a mapping"),
])
def test_a_speculative_config_vllm_would_refuse_is_refused_here(config, message):
    with pytest.raises(ParameterError, match=message) as err:
        ServeConfig(model="m", speculative_config=config)
    assert err.value.param == "speculative_config"


def test_speculation_the_engine_cannot_run_is_refused_before_it_starts():
    # vLLM runs EAGLE; the teaching engine n-gram lookup and draft models: said by name.
    eagle = ServeConfig(model="m", speculative_config={"method": "eagle", "model": "d",
                                                       "num_speculative_tokens": 3})
    assert json.loads(flag(vllm_command(eagle), "--speculative-config"))["method"] == "eagle"
    with pytest.raises(ParameterError, match="'eagle' is not implemented") as err:
        labkit_command(eagle)
    assert err.value.param == "speculative_config"
    # SGLang and TensorRT-LLM name speculation otherwise, with other meanings: no translation.
    for render, name in ((sglang_command, "SGLang"), (trtllm_command, "trtllm-serve")):
        with pytest.raises(ParameterError, match=f"{name} has its own flags") as err:
            render(ServeConfig(model="m", speculative_config=NGRAM))
        assert err.value.param == "speculative_config"


def test_one_name_per_engine():
    # The engines a lab detects are the real ones labkit launches, under the same names.
    assert set(ENGINE_PACKAGES) == set(COMMANDS) - {"labkit"}


def test_datasets_as_text():
    # The benchmark's view of a workload: one word per token, max_tokens its output length.
    data = random_dataset(20, input_len=30, output_len=8, range_ratio=0.5, seed=1)
    texts = data.bench_requests()
    assert [len(r.prompt.split()) for r in texts] == data.prompt_lens.tolist()
    assert [r.max_tokens for r in texts] == data.output_lens.tolist()
    assert 15 <= data.prompt_lens.min() and data.prompt_lens.max() <= 45
    assert 4 <= data.output_lens.min() and data.output_lens.max() <= 12
    assert data.bench_requests() == texts and data[:5].bench_requests() == texts[:5]
    shared = shared_prefix_dataset(6, prefix_len=50, suffix_len=5, output_len=4,
                                   num_prefixes=2).bench_requests()
    words = [r.prompt.split() for r in shared]
    assert [len(w) for w in words] == [55] * 6 and {r.max_tokens for r in shared} == {4}
    assert words[0][:50] == words[2][:50] != words[1][:50] == words[3][:50]
    assert words[0][50:] != words[2][50:]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")
    return model, Tokenizer(model)


@settings(max_examples=25, deadline=None)
@given(num=st.integers(1, 6), input_len=st.integers(2, 300), output_len=st.integers(1, 9),
       prefix_len=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_prompts_made_with_the_servers_tokenizer_have_the_workloads_lengths(
        tiny_tokenizer, num, input_len, output_len, prefix_len, seed):
    # What the server counts: the prompt encoded with its special tokens (the tiny Llama's
    # BOS), as usage.prompt_tokens reports it.
    _, tokenizer = tiny_tokenizer
    data = shared_prefix_dataset(num, prefix_len=prefix_len, suffix_len=input_len,
                                 output_len=output_len, num_prefixes=2, seed=seed) \
        if prefix_len else random_dataset(num, input_len, output_len, seed=seed)
    requests = data.bench_requests(tokenizer)
    served = [len(tokenizer.encode(r.prompt)) for r in requests]
    assert served == [r.prompt_tokens for r in requests] == data.prompt_lens.tolist()
    assert [r.max_tokens for r in requests] == data.output_lens.tolist()
    assert data.bench_requests(tokenizer) == requests           # the seed decides it all
    if prefix_len and num > 2:                                   # requests 0 and 2 share one
        ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
        assert ids[0][:prefix_len // 2] == ids[2][:prefix_len // 2]
    # Special tokens never appear inside a prompt: their markup is not text.
    assert not any(t in tokenizer.all_special_ids
                   for r in requests for t in tokenizer.encode(r.prompt, False))


def test_words_are_not_tokens(tiny_tokenizer, monkeypatch):
    # The view without a tokenizer is one word per token, which a BPE splits further: the
    # reason the benchmark takes the server's tokenizer.
    model, tokenizer = tiny_tokenizer
    data = random_dataset(40, input_len=64, output_len=32, seed=0)
    by_words = sum(len(tokenizer.encode(r.prompt)) for r in data.bench_requests())
    assert by_words > 2 * 40 * 64
    assert isinstance(server_tokenizer(model), Tokenizer) and server_tokenizer(None) is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # a lab environment without it
    with pytest.raises(ParameterError, match="tokenizer must be a model directory") as error:
        server_tokenizer(model.parent)
    assert error.value.param == "tokenizer"


def test_latencies_count_the_servers_tokens_not_chunks():
    # A busy server streamed 9 tokens in 3 chunks, at 0.1 s (1 token), 0.3 s and 0.5 s (4 each):
    # TPOT spreads the 0.4 s after the first chunk over the 8 tokens after the first.
    m = request_latencies("r", 20, 9, 0.0, [0.1, 0.3, 0.5])
    assert (m.prompt_len, m.output_len) == (20, 9)
    assert (m.ttft_ms, m.e2el_ms, m.tpot_ms) == pytest.approx((100, 500, 400 / 8))
    assert m.itl_ms == pytest.approx((200, 200))
    with pytest.raises(ValueError, match="received no token"):
        request_latencies("r", 20, 9, 0.0, [])


def test_labkit_serve_subprocess_and_benchmark(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    cfg = ServeConfig(model=str(model), served_model_name="tiny", port=free_port(),
                      max_model_len=512)
    data = random_dataset(12, 20, 6)
    with ServerProcess(command_for("labkit", cfg), cfg.base_url, startup_timeout_s=120) as server:
        result = benchmark(server.base_url, "tiny", data, request_rate=40, max_concurrency=4,
                           slos_ms={"ttft": 60_000}, tokenizer=model)
        assert result.completed == 12 and result.total_output_tokens == 12 * 6
        # The server's own count (usage.prompt_tokens) is the workload's, token for token.
        assert result.total_input_tokens == int(data.prompt_lens.sum())
        assert result.request_goodput > 0
        assert 0 < result.median_ttft_ms <= result.p99_e2el_ms
        pid = server.process.pid
        log_path, logged = server.log_path, server.log_lines()
        assert os.path.exists(log_path)
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server is gone, not orphaned
    # Its log file too; its lines stay readable.
    assert not os.path.exists(log_path)
    assert server.log_lines()[:len(logged)] == logged


def test_a_server_with_a_key_is_benchmarked_with_it_and_its_start_is_timed(tmp_path):
    """The capstone lab's server: the key travels in VLLM_API_KEY, as in chapter 8; the
    benchmark sends it; a request without it is refused; the start is measured."""
    model = write_tiny_model(tmp_path / "tiny")
    cfg = ServeConfig(model=str(model), served_model_name="tiny", port=free_port(),
                      max_model_len=256)
    key = "a-key-for-the-test"
    with ServerProcess(command_for("labkit", cfg), cfg.base_url, startup_timeout_s=120,
                       env={"VLLM_API_KEY": key}) as server:
        assert 0 < server.ready_after_s < 120
        assert key not in " ".join(server.command)  # not in ps
        data = random_dataset(4, 8, 4)
        with pytest.raises(ParameterError, match="no request finished"):
            benchmark(server.base_url, "tiny", data, max_concurrency=2)  # 401, every one
        served = benchmark(server.base_url, "tiny", data, max_concurrency=2, api_key=key)
        assert served.completed == 4 and served.total_output_tokens == 4 * 4
    assert ServerProcess([], "http://127.0.0.1:1").ready_after_s is None  # not started


def test_server_that_fails_to_start_reports_its_log(tmp_path):
    cfg = ServeConfig(model=str(tmp_path / "missing"), port=18632)
    server = ServerProcess(command_for("labkit", cfg), cfg.base_url, startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="not a model directory"):
        server.start()
    assert not os.path.exists(server.log_path)  # no log file left behind
    assert "not a model directory" in "".join(server.log_lines())


def test_multi_node_commands():
    commands = multi_node_commands(CFG, pipeline_parallel_size=2, head_address="10.0.0.1")
    head, other, serve = commands.values()
    assert head == ["ray", "start", "--head", "--port", "6379"]
    assert other == ["ray", "start", "--address=10.0.0.1:6379"]
    assert (flag(serve, "--tensor-parallel-size"), flag(serve, "--pipeline-parallel-size"),
            flag(serve, "--distributed-executor-backend")) == ("4", "2", "ray")


def test_a_server_started_from_a_worker_thread_outlives_the_thread(tmp_path):
    """The parent-death signal fires when the forking *thread* exits: a server started from a
    thread pool must not get it, and ``with`` on a started server keeps the one process."""
    import sys
    import threading
    import time

    (tmp_path / "health").write_text("ok")  # http.server answers GET /health with 200
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "http.server", str(port), "--bind",
                            "127.0.0.1", "--directory", str(tmp_path)],
                           f"http://127.0.0.1:{port}", startup_timeout_s=30)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        time.sleep(0.5)
        assert server.process.poll() is None
        first = server.process.pid
        with server:
            assert server.process.pid == first
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_trtllm_kv_fraction_matches_vllms_cache_by_hand():
    # 80 GiB GPU, 16 GiB weights, 2 GiB activations, vLLM at 0.9: KV = 72 - 18 = 54 GiB.
    # TensorRT-LLM sees 80 - 18 = 62 GiB free, so the matching fraction is 54 / 62.
    gib = 2**30
    assert trtllm_kv_fraction(0.9, 80 * gib, 16 * gib, 2 * gib) == pytest.approx(54 / 62)
    assert trtllm_kv_fraction(1.0, 80 * gib, 16 * gib) == pytest.approx(1.0)
    with pytest.raises(ParameterError, match="leaves no KV cache") as err:
        trtllm_kv_fraction(0.2, 80 * gib, 16 * gib)
    assert err.value.param == "gpu_memory_utilization"
    with pytest.raises(ValueError, match="gpu_memory_bytes must be in"):
        trtllm_kv_fraction(0.9, 0, 0)
    with pytest.raises(ValueError, match="kv_cache_free_gpu_memory_fraction must be in"):
        trtllm_command(CFG, kv_cache_free_gpu_memory_fraction=1.5)


def test_a_process_group_is_signalled_asked_after_and_gone_is_no_error():
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    try:
        assert group_alive(leader.pid)
        assert signal_group(leader.pid, signal.SIGKILL) is True
        leader.wait(timeout=10)
        assert not group_alive(leader.pid)
        assert signal_group(leader.pid, signal.SIGTERM) is False  # gone: no ProcessLookupError
        kill_group(leader)  # and the same for a group already reaped
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_one_polling_loop_sync_and_async_with_the_same_contract():
    """The predicate is polled until true (a coroutine function too, for a health probe);
    past the deadline, TimeoutError names what was awaited. Counters, no clock: no test
    depends on speed."""
    calls = []

    def third_time():
        calls.append(1)
        return len(calls) >= 3

    async def probe():
        return third_time()

    assert wait_until(third_time, 5, 0.001) >= 0 and len(calls) == 3
    calls.clear()
    assert asyncio.run(wait_until_async(probe, 5, 0.001)) >= 0 and len(calls) == 3
    calls.clear()
    assert asyncio.run(wait_until_async(third_time, 5, 0.001)) >= 0 and len(calls) == 3
    with pytest.raises(TimeoutError, match="the backend healthy still not true after 0.05 s"):
        asyncio.run(wait_until_async(lambda: False, 0.05, 0.01, what="the backend healthy"))
    calls.clear()
    with pytest.raises(TimeoutError):   # a zero deadline polls once, then gives up
        asyncio.run(wait_until_async(third_time, 0, 0.01))
    assert len(calls) == 1
    with pytest.raises(ParameterError, match="interval_s"):
        asyncio.run(wait_until_async(third_time, 1, 0))
