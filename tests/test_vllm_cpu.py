"""The vLLM-on-CPU path: its command line, environment and offline worker."""

import sys

import httpx
import pytest

from labkit import vllm_cpu
from labkit.engine import SamplingParams
from labkit.launch import ServeConfig, ServerProcess, free_port, vllm_command


def test_server_command_is_vllm_serve_as_a_module():
    cfg = ServeConfig(model="/m", served_model_name="course-model", port=8123,
                      max_model_len=1024)
    command = vllm_cpu.server_command("/venv/bin/python", vllm_command(cfg))
    assert command[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                           "--model", "/m"]
    assert command[5:] == vllm_command(cfg)[3:]  # every flag of `vllm serve`, unchanged
    with pytest.raises(ValueError, match="vllm_serve must start with 'vllm serve'"):
        vllm_cpu.server_command("/p", ["sglang", "serve", "/m"])
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
    with pytest.raises(httpx.HTTPError):
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
