"""The vLLM-on-CPU path: its command line, environment, offline worker, KV cache and ranks."""

import sys

import httpx
import pytest

from labkit import vllm_cpu
from labkit.checks import ParameterError
from labkit.engine import SamplingParams, write_tiny_model
from labkit.hardware import ModelSpec
from labkit.lab import detect
from labkit.launch import ServeConfig, multi_node_commands, vllm_command
from labkit.process import ServerProcess, free_port


def test_server_command_is_vllm_serve_as_a_module():
    cfg = ServeConfig(model="/m", served_model_name="course-model", port=8123,
                      max_model_len=1024)
    command = vllm_cpu.server_command("/venv/bin/python", vllm_command(cfg))
    assert command[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                           "--model", "/m"]
    assert command[5:] == vllm_command(cfg)[3:]  # every flag of `vllm serve`, unchanged
    with pytest.raises(ParameterError, match="vllm_serve must start with 'vllm serve'") as err:
        vllm_cpu.server_command("/p", ["sglang", "serve", "/m"])
    assert err.value.param == "vllm_serve"
    assert vllm_cpu.cpu_env(2) == {"VLLM_CPU_KVCACHE_SPACE": "2"}


def test_server_process_env_and_attach(tmp_path):
    """A server gets its extra environment; attaching leaves someone else's server running."""
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(
        "import http.server, os\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "        self.wfile.write(os.environ.get('PROBE', '').encode())\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    base = f"http://127.0.0.1:{port}"
    with ServerProcess([sys.executable, str(script)], base, env={"PROBE": "yes"},
                       startup_timeout_s=20) as owner:
        assert httpx.get(base + "/health").text == "yes"
        guest = ServerProcess.attach(base)
        guest.stop()
        assert httpx.get(base + "/health").status_code == 200   # still up
    assert owner.process.poll() is not None
    with pytest.raises(RuntimeError, match="not ready"):  # nothing answers there any more
        ServerProcess.attach(base)


def test_remote_llm_speaks_the_worker_protocol(tmp_path):
    """RemoteLLM against a stand-in worker that echoes what it was sent: the protocol, the
    fields passed to vLLM and the records built from the answer."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    if r['op'] == 'init':\n"
        "        print(json.dumps({'ok': r['kwargs']['model'] == 'm'}), flush=True)\n"
        "        continue\n"
        "    outs = [{'request_id': str(i), 'prompt': p if isinstance(p, str) else None,\n"
        "             'prompt_token_ids': [1], 'num_cached_tokens': 0, 'finished': True,\n"
        "             'outputs': [{'index': 0, 'text': json.dumps(q, sort_keys=True),\n"
        "                          'token_ids': [2], 'finish_reason': 'length',\n"
        "                          'stop_reason': None}]}\n"
        "            for i, (p, q) in enumerate(zip(r['prompts'], r['params']))]\n"
        "    print(json.dumps({'outputs': outs}), flush=True)\n")
    fake.chmod(0o755)
    llm = vllm_cpu.RemoteLLM(str(fake), model="m")
    out = llm.generate(["a", [5, 6]], SamplingParams(temperature=0, max_tokens=3, stop=["."]))
    sent = [__import__("json").loads(o.outputs[0].text) for o in out]
    assert sent[0]["temperature"] == 0 and sent[0]["max_tokens"] == 3
    assert sent[0]["stop"] == ["."] and "regex" not in sent[0]  # only fields vLLM shares
    assert out[0].prompt == "a" and out[1].prompt is None and out[0].finished
    llm.close()


def test_int4_kernels_need_avx512():
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n"
    assert not vllm_cpu.int4_kernels_available(avx2)
    assert vllm_cpu.int4_kernels_available(avx512)
    assert not vllm_cpu.int4_kernels_available("model name\t: avx512f in a name, not a flag\n")


# -- the chapter 2 and 3 labs: KV cache, ranks, vLLM's own parser ----------------------------

def test_cpu_kv_cache_is_its_memory_over_the_bytes_per_token(tmp_path):
    spec = ModelSpec.from_hf_config(write_tiny_model(tmp_path / "tiny"))
    # 2 layers x (K, V) x 2 KV heads x 32 head_dim x 2 bytes (bf16) = 512 bytes per token.
    plan = vllm_cpu.plan_cpu_kv_cache(spec, max_model_len=1024)
    assert (plan.bytes_per_token, plan.tokens, plan.max_concurrency) == (512, 2**21, 2048.0)
    # vLLM's CPU log with VLLM_CPU_KVCACHE_SPACE=1 and --tensor-parallel-size 2 said 4,194,304:
    # each rank holds one of the two KV heads in its own GiB.
    assert vllm_cpu.plan_cpu_kv_cache(spec, 1024, tensor_parallel_size=2).tokens == 2**22
    assert vllm_cpu.plan_cpu_kv_cache(spec, 1024, "float32").tokens == 2**20
    # Requests are counted in whole blocks of 128: 1000 tokens take 8 blocks, as 1024 do.
    odd = vllm_cpu.plan_cpu_kv_cache(spec, 1000)
    assert odd.max_concurrency == 2048.0 and odd.tokens == 2048 * 1000
    with pytest.raises(ParameterError, match="dtype must be one of") as err:
        vllm_cpu.plan_cpu_kv_cache(spec, 1024, "int3")
    assert err.value.param == "dtype"


def test_cpu_kv_cache_matches_vllms_startup_line(tmp_path):
    """The plan against the line vLLM CPU 0.32 logged serving the tiny model with
    ``VLLM_CPU_KVCACHE_SPACE=1 --max-model-len 1024``, as :func:`read_kv_cache_line` reads it."""
    from labkit.harness.lab_engines import read_kv_cache_line

    spec = ModelSpec.from_hf_config(write_tiny_model(tmp_path / "tiny"))
    logged = read_kv_cache_line([
        "(EngineCore pid=1) INFO 11-30 22:56:08 [kv_cache_utils.py:2327] CPU KV cache size: "
        "2,097,152 tokens, Maximum concurrency for 1,024 tokens per request: 2048.00x\n"])
    plan = vllm_cpu.plan_cpu_kv_cache(spec, 1024)
    assert (plan.tokens, round(plan.max_concurrency, 2)) == (logged.tokens,
                                                             logged.max_concurrency)


def test_each_rank_gets_its_own_cores():
    assert vllm_cpu.omp_threads_bind(2, [0, 1]) == "0|1"
    assert vllm_cpu.omp_threads_bind(2, [3, 0, 1, 2]) == "0,1|2,3"
    assert vllm_cpu.omp_threads_bind(1, [0, 1]) == "0,1"
    assert vllm_cpu.parallel_env(1) == {}
    assert vllm_cpu.parallel_env(2, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with pytest.raises(ParameterError, match="3 ranks need 3 CPUs") as err:
        vllm_cpu.omp_threads_bind(3, [0, 1])
    assert err.value.param == "world_size"


def test_rank_lines_from_a_tensor_parallel_log():
    log = ["(EngineCore pid=5) INFO 11-30 22:58:22 [ompmultiprocessing.py:185] \tlocal_rank=1, "
           "core ids=[1]\n",
           "(Worker pid=7) INFO 11-30 22:58:33 [parallel_state.py:1906] world_size=2 rank=1 "
           "local_rank=1 distributed_init_method=file:///tmp/x backend=gloo\n",
           "(Worker_TP1 pid=7) INFO 11-30 22:58:34 [default_loader.py:501] Loading weights\n",
           # coloured, as vLLM writes it under Jupyter
           "\x1b[0;36m(Worker_TP0 pid=6)\x1b[0;0m \x1b[32mINFO\x1b[0m "
           "\x1b[90m11-30 23:40:07\x1b[0m \x1b[90m[cpu_worker.py:260]\x1b[0m "
           "Explicitly set (1.0/23.54) GiB for KV cache\n"]
    assert vllm_cpu.rank_log_lines(log) == [
        "EngineCore: local_rank=1, core ids=[1]",
        "Worker: world_size=2 rank=1 local_rank=1 distributed_init_method=file:///tmp/x "
        "backend=gloo",
        "Worker_TP0: Explicitly set (1.0/23.54) GiB for KV cache"]


@pytest.mark.real_engine  # vLLM CPU
def test_vllms_own_parser_reads_the_multi_node_command():
    python = detect().vllm_cpu_python
    if python is None:
        pytest.skip("vLLM's CPU build is not installed here (make vllm-env)")
    cfg = ServeConfig(model="meta-llama/Meta-Llama-3-70B-Instruct", tensor_parallel_size=4,
                      max_model_len=8192, quantization="awq")
    serve = multi_node_commands(cfg, pipeline_parallel_size=2)["then, on the head node"]
    parsed = vllm_cpu.parse_serve_command(python, serve)
    assert (parsed["tensor_parallel_size"], parsed["pipeline_parallel_size"],
            parsed["distributed_executor_backend"], parsed["quantization"],
            parsed["max_model_len"]) == (4, 2, "ray", "awq", 8192)
    with pytest.raises(ParameterError, match="rejected") as err:
        vllm_cpu.parse_serve_command(python, [*serve, "--tensor-parallel-sise", "2"])
    assert err.value.param == "vllm_serve"
