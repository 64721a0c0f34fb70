"""The engine a lab runs on each path, and the chapter 2-3 experiments on it
(labkit.harness.lab_engines)."""

import asyncio
import json
from dataclasses import replace

import pytest

from labkit.simulate import random_dataset
from labkit.checks import ParameterError
from labkit.engine import EngineArgs, write_tiny_model
from labkit.engine.args import parse_engine_args
from labkit.harness.lab_engines import (LAB_SERVER_DEFAULTS, benchmark_variants, choose_engine,
                                        decode_step_s, kv_cache_predicted, kv_cache_reported,
                                        lab_server_command, lab_server_env,
                                        max_tensor_parallel_size, offline_api, read_kv_cache_line,
                                        lab_model, served_model_spec, start_lab_server,
                                        vllm_python)
from labkit.lab import LabPath
from labkit.launch import ServeConfig, labkit_command

VLLM_CPU = LabPath(gpus=(), engines=(), vllm_cpu_python="/venv/bin/python")
TEACHING = LabPath(gpus=(), engines=())


def flag(command, name):
    return command[command.index(name) + 1]


def _tiny_cfg(tmp_path, **options):
    model = write_tiny_model(tmp_path / "tiny")
    return ServeConfig(model=str(model), **{**LAB_SERVER_DEFAULTS, **options})


def test_choose_engine_falls_back_to_the_teaching_engine():
    cpu = LabPath(gpus=(), engines=("vllm",))
    gpu = LabPath(gpus=("NVIDIA H100",), engines=("vllm",))
    assert choose_engine("vllm", cpu) == "labkit" and choose_engine("vllm", gpu) == "vllm"
    assert choose_engine("vllm", VLLM_CPU) == "vllm"
    assert choose_engine("sglang", VLLM_CPU) == "labkit"
    assert choose_engine("trtllm", gpu) == "labkit"
    with_trt = LabPath(gpus=("NVIDIA H100",), engines=("trtllm",))
    assert choose_engine("trtllm", with_trt) == "trtllm"


def test_bad_engines_name_the_parameter(tmp_path):
    with pytest.raises(ParameterError, match="engine must be 'vllm' or 'labkit'") as err:
        offline_api("sglang", TEACHING)
    assert err.value.param == "engine"
    with pytest.raises(ParameterError, match="engine must be 'vllm' or 'labkit'") as err:
        kv_cache_predicted("sglang", _tiny_cfg(tmp_path), TEACHING)
    assert err.value.param == "engine"
    with pytest.raises(ParameterError, match="no config.json") as err:
        served_model_spec(ServeConfig(model="no-such-org/no-such-model"))
    assert err.value.param == "model"


def test_the_teaching_engines_args_come_from_its_own_parser(tmp_path):
    # What `labkit serve` would run with: the flags labkit_command renders, parsed back.
    cfg = _tiny_cfg(tmp_path, max_num_seqs=3, extra_args=["--no-enable-prefix-caching"])
    command = labkit_command(cfg)
    args = parse_engine_args(command[command.index("serve") + 1:])
    assert args == EngineArgs(model=cfg.model, max_num_seqs=3, max_model_len=1024,
                              enable_prefix_caching=False)


def test_vllm_kv_cache_line_is_read_from_its_log():
    # Lines as vLLM CPU 0.32 writes them (kv_cache_utils.py, update_kv_cache_capacity).
    log = ["(EngineCore pid=1) INFO 11-30 [core.py:1] Initializing\n",
           "(EngineCore pid=1) INFO 11-30 22:56:08 [kv_cache_utils.py:2327] CPU KV cache size: "
           "2,097,152 tokens, Maximum concurrency for 1,024 tokens per request: 2048.00x\n"]
    report = read_kv_cache_line(log)
    assert (report.tokens, report.max_concurrency) == (2_097_152, 2048.0)
    assert report.source.startswith("CPU KV cache size")
    gpu = ("GPU KV cache size: 1,234,560 tokens, Maximum concurrency for 32,768 tokens per "
           "request: 37.68x")
    assert read_kv_cache_line([gpu]).tokens == 1_234_560
    coloured = "\x1b[0;36m(EngineCore pid=1)\x1b[0;0m \x1b[32mINFO\x1b[0m " + gpu
    assert read_kv_cache_line([coloured]).max_concurrency == 37.68
    assert read_kv_cache_line(["nothing here"]) is None


def test_kv_cache_prediction_on_each_cpu_path(tmp_path):
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


def test_the_server_a_lab_runs_on_each_path(tmp_path):
    cfg = _tiny_cfg(tmp_path, tensor_parallel_size=2)
    command = lab_server_command("vllm", cfg, VLLM_CPU)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--model") == cfg.model and flag(command, "--tensor-parallel-size") == "2"
    assert command.count("--enforce-eager") == 1  # compiling on CPU costs starts, buys no speed
    eager = replace(cfg, extra_args=("--enforce-eager",))
    assert lab_server_command("vllm", eager, VLLM_CPU).count("--enforce-eager") == 1
    # A quantized checkpoint keeps vLLM's default (its CPU W4A16 path failed in eager mode).
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "awq"}}))
    assert "--enforce-eager" not in lab_server_command("vllm", cfg, VLLM_CPU)
    env = lab_server_env("vllm", cfg, VLLM_CPU)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" in env
    one = _tiny_cfg(tmp_path)
    assert lab_server_command("labkit", one, TEACHING) == labkit_command(one)
    assert lab_server_env("labkit", one, TEACHING) == {}
    assert vllm_python(VLLM_CPU) == "/venv/bin/python" and vllm_python(TEACHING) is None
    assert max_tensor_parallel_size(TEACHING) == 1
    assert max_tensor_parallel_size(LabPath(gpus=("H100",) * 4, engines=("vllm",))) == 4
    # The teaching engine has no ranks.
    with pytest.raises(ParameterError, match="one device") as err:
        start_lab_server("vllm", TEACHING, tensor_parallel_size=2)
    assert err.value.param == "tensor_parallel_size"


def test_the_tiny_model_is_written_once_and_never_seen_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    written = []

    def racing_writer(path):
        # Another process finishes first: its copy lands at the target while ours is written.
        if not written:
            write_tiny_model(tmp_path / "tiny-llama")
        written.append(path)
        return write_tiny_model(path)

    monkeypatch.setattr("labkit.harness.lab_engines.write_tiny_model", racing_writer)
    model = lab_model("vllm", TEACHING)
    assert model == str(tmp_path / "tiny-llama") and len(written) == 1
    assert written[0].parent == tmp_path and written[0] != tmp_path / "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]  # ours cleaned up
    assert lab_model("vllm", TEACHING) == model and len(written) == 1  # reused, not rewritten
    (tmp_path / "tiny-llama" / "model.safetensors").unlink()
    (tmp_path / "tiny-llama" / "config.json").write_text("{}")
    with pytest.raises(ParameterError, match="incomplete") as err:
        lab_model("vllm", TEACHING)
    assert err.value.param == "LABKIT_CACHE"


@pytest.mark.slow
def test_variants_one_server_at_a_time_and_decode_step(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    requests = random_dataset(6, input_len=20, output_len=4, seed=0)
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
