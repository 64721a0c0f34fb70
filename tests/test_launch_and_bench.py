"""Launch commands, the server process manager, and the benchmark harness end to end."""

import os

import pytest

from labkit.bench import benchmark, random_dataset, request_latencies, shared_prefix_dataset
from labkit.engine import write_tiny_model
from labkit.lab import ENGINE_PACKAGES, LabPath
from labkit.launch import (COMMANDS, ServeConfig, ServerProcess, choose_engine, command_for,
                           labkit_command, sglang_command, trtllm_build_commands,
                           trtllm_command, trtllm_kv_fraction, vllm_command)

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
    with pytest.raises(ValueError, match="engine must be one of"):
        command_for("ollama", ServeConfig(model="m"))
    with pytest.raises(ValueError, match="one device, unquantized"):
        labkit_command(CFG)


def test_choose_engine_falls_back_to_the_teaching_engine():
    cpu = LabPath(gpus=(), engines=("vllm",))
    gpu = LabPath(gpus=("NVIDIA H100",), engines=("vllm",))
    vllm_cpu = LabPath(gpus=(), engines=(), vllm_cpu_python="/venv/bin/python")
    assert choose_engine("vllm", cpu) == "labkit" and choose_engine("vllm", gpu) == "vllm"
    assert choose_engine("vllm", vllm_cpu) == "vllm"
    assert choose_engine("sglang", vllm_cpu) == "labkit"
    assert choose_engine("trtllm", gpu) == "labkit"
    with_trt = LabPath(gpus=("NVIDIA H100",), engines=("trtllm",))
    assert choose_engine("trtllm", with_trt) == "trtllm"


def test_one_name_per_engine():
    # The engines a lab detects are the real ones labkit launches, under the same names.
    assert set(ENGINE_PACKAGES) == set(COMMANDS) - {"labkit"}


def test_datasets():
    data = random_dataset(20, input_words=30, output_len=8, range_ratio=0.5, seed=1)
    lengths = [len(r.prompt.split()) for r in data]
    assert min(lengths) >= 15 and max(lengths) <= 45 and {r.max_tokens for r in data} == {8}
    shared = shared_prefix_dataset(6, prefix_words=50, suffix_words=5, output_len=4,
                                   num_prefixes=2)
    assert shared[0].prompt.split()[:50] == shared[2].prompt.split()[:50]
    assert shared[0].prompt.split()[:50] != shared[1].prompt.split()[:50]


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
    cfg = ServeConfig(model=str(model), served_model_name="tiny", port=18631, max_model_len=512)
    with ServerProcess(command_for("labkit", cfg), cfg.base_url, startup_timeout_s=120) as server:
        result = benchmark(server.base_url, "tiny", random_dataset(12, 20, 6), request_rate=40,
                           max_concurrency=4, slos_ms={"ttft": 60_000})
        assert result.completed == 12 and result.total_output_tokens == 12 * 6
        assert result.total_input_tokens > 0 and result.request_goodput > 0
        assert 0 < result.median_ttft_ms <= result.p99_e2el_ms
        pid = server.process.pid
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server is gone, not orphaned


def test_server_that_fails_to_start_reports_its_log(tmp_path):
    cfg = ServeConfig(model=str(tmp_path / "missing"), port=18632)
    with pytest.raises(RuntimeError, match="not a model directory"):
        ServerProcess(command_for("labkit", cfg), cfg.base_url, startup_timeout_s=60).start()


# -- the vLLM-on-CPU path's helpers (chapter 2 and 3 labs) ------------------------------------

def _tiny_cfg(tmp_path, **options):
    from labkit.launch import LAB_SERVER_DEFAULTS

    model = write_tiny_model(tmp_path / "tiny")
    return ServeConfig(model=str(model), **{**LAB_SERVER_DEFAULTS, **options})


VLLM_CPU = LabPath(gpus=(), engines=(), vllm_cpu_python="/venv/bin/python")
TEACHING = LabPath(gpus=(), engines=())


def test_vllm_kv_cache_line_is_read_from_its_log():
    from labkit.launch import read_kv_cache_line

    log = ["(EngineCore pid=1) INFO 11-30 [core.py:1] Initializing\n",
           "(EngineCore pid=1) INFO 11-30 22:56:08 [kv_cache_utils.py:2327] CPU KV cache size: "
           "2,097,152 tokens, Maximum concurrency for 1,024 tokens per request: 2048.00x\n"]
    report = read_kv_cache_line(log)
    assert (report.tokens, report.max_concurrency) == (2_097_152, 2048.0)
    assert report.source.startswith("CPU KV cache size")
    gpu = ("GPU KV cache size: 1,234,560 tokens, Maximum concurrency for 32,768 tokens per "
           "request: 37.68x")
    assert read_kv_cache_line([gpu]).tokens == 1_234_560
    assert read_kv_cache_line(["nothing here"]) is None


def test_cpu_kv_cache_is_its_memory_over_the_bytes_per_token(tmp_path):
    from labkit.hardware import ModelSpec
    from labkit.vllm_cpu import plan_cpu_kv_cache

    spec = ModelSpec.from_hf_config(write_tiny_model(tmp_path / "tiny"))
    # 2 layers x (K, V) x 2 KV heads x 32 head_dim x 2 bytes (bf16) = 512 bytes per token.
    plan = plan_cpu_kv_cache(spec, max_model_len=1024)
    assert (plan.bytes_per_token, plan.tokens, plan.max_concurrency) == (512, 2**21, 2048.0)
    # vLLM's CPU log with VLLM_CPU_KVCACHE_SPACE=1 and --tensor-parallel-size 2 said 4,194,304:
    # each rank holds one of the two KV heads in its own GiB.
    assert plan_cpu_kv_cache(spec, 1024, tensor_parallel_size=2).tokens == 2**22
    assert plan_cpu_kv_cache(spec, 1024, "float32").tokens == 2**20
    # Requests are counted in whole blocks of 128: 1000 tokens take 8 blocks, as 1024 do.
    odd = plan_cpu_kv_cache(spec, 1000)
    assert odd.max_concurrency == 2048.0 and odd.tokens == 2048 * 1000
    with pytest.raises(ValueError, match="dtype must be one of"):
        plan_cpu_kv_cache(spec, 1024, "int3")


def test_kv_cache_prediction_on_each_cpu_path(tmp_path):
    from labkit.launch import kv_cache_predicted, kv_cache_reported

    cfg = _tiny_cfg(tmp_path)
    assert kv_cache_predicted("vllm", cfg, VLLM_CPU).tokens == 2**21
    # The teaching engine's own count (what it logs as "GPU KV cache size") is chapter 1's rule.
    engine_says = kv_cache_reported("labkit", cfg, server=None)
    predicted = kv_cache_predicted("labkit", cfg, TEACHING)
    assert engine_says.tokens == predicted.tokens > 0
    assert engine_says.max_concurrency == pytest.approx(predicted.max_concurrency)

    class Logged:
        log_path = "log"

        def log_lines(self):
            return ["CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 1,024 tokens "
                    "per request: 2048.00x"]

    assert kv_cache_reported("vllm", cfg, Logged()).tokens == 2**21
    Logged.log_lines = lambda self: ["no such line"]
    with pytest.raises(RuntimeError, match="no KV cache size line"):
        kv_cache_reported("vllm", cfg, Logged())


def test_each_rank_gets_its_own_cores():
    from labkit.vllm_cpu import omp_threads_bind, parallel_env

    assert omp_threads_bind(2, [0, 1]) == "0|1"
    assert omp_threads_bind(2, [3, 0, 1, 2]) == "0,1|2,3"
    assert omp_threads_bind(1, [0, 1]) == "0,1"
    assert parallel_env(1) == {} and parallel_env(2, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with pytest.raises(ValueError, match="3 ranks need 3 CPUs"):
        omp_threads_bind(3, [0, 1])


def test_the_server_a_lab_runs_on_each_path(tmp_path):
    from labkit.launch import (lab_server_command, lab_server_env, max_tensor_parallel_size,
                               start_lab_server, vllm_python)

    cfg = _tiny_cfg(tmp_path, tensor_parallel_size=2)
    command = lab_server_command("vllm", cfg, VLLM_CPU)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--model") == cfg.model and flag(command, "--tensor-parallel-size") == "2"
    env = lab_server_env("vllm", cfg, VLLM_CPU)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" in env
    one = _tiny_cfg(tmp_path)
    assert lab_server_command("labkit", one, TEACHING) == labkit_command(one)
    assert lab_server_env("labkit", one, TEACHING) == {}
    assert vllm_python(VLLM_CPU) == "/venv/bin/python" and vllm_python(TEACHING) is None
    assert max_tensor_parallel_size(TEACHING) == 1
    assert max_tensor_parallel_size(LabPath(gpus=("H100",) * 4, engines=("vllm",))) == 4
    with pytest.raises(ValueError, match="one device"):  # the teaching engine has no ranks
        start_lab_server("vllm", TEACHING, tensor_parallel_size=2)


def test_multi_node_commands():
    from labkit.launch import multi_node_commands

    commands = multi_node_commands(CFG, pipeline_parallel_size=2, head_address="10.0.0.1")
    head, other, serve = commands.values()
    assert head == ["ray", "start", "--head", "--port", "6379"]
    assert other == ["ray", "start", "--address=10.0.0.1:6379"]
    assert (flag(serve, "--tensor-parallel-size"), flag(serve, "--pipeline-parallel-size"),
            flag(serve, "--distributed-executor-backend")) == ("4", "2", "ray")


def test_rank_lines_from_a_tensor_parallel_log():
    from labkit.vllm_cpu import rank_log_lines

    log = ["(EngineCore pid=5) INFO 11-30 22:58:22 [ompmultiprocessing.py:185] \tlocal_rank=1, "
           "core ids=[1]\n",
           "(Worker pid=7) INFO 11-30 22:58:33 [parallel_state.py:1906] world_size=2 rank=1 "
           "local_rank=1 distributed_init_method=file:///tmp/x backend=gloo\n",
           "(Worker_TP1 pid=7) INFO 11-30 22:58:34 [default_loader.py:501] Loading weights\n",
           # coloured, as vLLM writes it under Jupyter
           "\x1b[0;36m(Worker_TP0 pid=6)\x1b[0;0m \x1b[32mINFO\x1b[0m "
           "\x1b[90m11-30 23:40:07\x1b[0m \x1b[90m[cpu_worker.py:260]\x1b[0m "
           "Explicitly set (1.0/23.54) GiB for KV cache\n"]
    assert rank_log_lines(log) == [
        "EngineCore: local_rank=1, core ids=[1]",
        "Worker: world_size=2 rank=1 local_rank=1 distributed_init_method=file:///tmp/x "
        "backend=gloo",
        "Worker_TP0: Explicitly set (1.0/23.54) GiB for KV cache"]


def test_variants_one_server_at_a_time_and_decode_step(tmp_path, monkeypatch):
    import asyncio

    from labkit.launch import benchmark_variants, decode_step_s, start_lab_server

    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    requests = random_dataset(6, input_words=20, output_len=4, seed=0)
    results = asyncio.run(benchmark_variants(
        requests, {"one at a time": {"max_num_seqs": 1},
                   "no prefix cache": {"extra_args": ["--no-enable-prefix-caching"]}},
        path=TEACHING, warmup_requests=1))
    assert list(results) == ["one at a time", "no prefix cache"]
    assert all(r.completed == 6 and r.total_output_tokens == 24 for r in results.values())
    _, cfg, server = start_lab_server("vllm", TEACHING)
    try:
        assert decode_step_s(cfg.base_url, cfg.name, num_tokens=8, repeats=3) > 0
        baseline = asyncio.run(benchmark_variants(requests, {}, baseline=("on", cfg.base_url),
                                                  path=TEACHING, warmup_requests=0))
        assert list(baseline) == ["on"] and baseline["on"].completed == 6
    finally:
        server.stop()


def test_vllms_own_parser_reads_the_multi_node_command():
    from labkit.lab import detect
    from labkit.launch import multi_node_commands
    from labkit.vllm_cpu import parse_serve_command

    python = detect().vllm_cpu_python
    if python is None:
        pytest.skip("vLLM's CPU build is not installed here (make vllm-env)")
    serve = multi_node_commands(CFG, pipeline_parallel_size=2)["then, on the head node"]
    parsed = parse_serve_command(python, serve)
    assert (parsed["tensor_parallel_size"], parsed["pipeline_parallel_size"],
            parsed["distributed_executor_backend"], parsed["quantization"],
            parsed["max_model_len"]) == (4, 2, "ray", "awq", 8192)
    with pytest.raises(ValueError, match="rejected"):
        parse_serve_command(python, [*serve, "--tensor-parallel-sise", "2"])


def test_a_server_started_from_a_worker_thread_outlives_the_thread(tmp_path):
    """The parent-death signal fires when the forking *thread* exits: a server started from a
    thread pool must not get it, and ``with`` on a started server keeps the one process."""
    import sys
    import threading
    import time

    from labkit.launch import ServerProcess, free_port

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
    with pytest.raises(ValueError, match="leaves no KV cache"):
        trtllm_kv_fraction(0.2, 80 * gib, 16 * gib)
    with pytest.raises(ValueError, match="gpu_memory_bytes must be in"):
        trtllm_kv_fraction(0.9, 0, 0)
    with pytest.raises(ValueError, match="kv_cache_free_gpu_memory_fraction must be in"):
        trtllm_command(CFG, kv_cache_free_gpu_memory_fraction=1.5)
