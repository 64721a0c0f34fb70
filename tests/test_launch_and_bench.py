"""Launch commands, the server process manager, and the benchmark harness end to end."""

import os

import pytest

from labkit.bench import benchmark, random_dataset, shared_prefix_dataset
from labkit.engine import write_tiny_model
from labkit.lab import ENGINE_PACKAGES, LabPath
from labkit.launch import (COMMANDS, ServeConfig, ServerProcess, choose_engine, command_for,
                           labkit_command, sglang_command, trtllm_build_commands,
                           trtllm_command, vllm_command)

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
    assert choose_engine("vllm", cpu) == "labkit" and choose_engine("vllm", gpu) == "vllm"
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
