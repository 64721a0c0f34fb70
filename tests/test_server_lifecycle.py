"""When the engine itself breaks: open streams end with an error, ``/health`` turns 503, new
requests are refused, and the process still stops on SIGTERM within 5 s."""

import json
import signal
import sys
import textwrap
import time

import httpx
import pytest
from conftest import serve_in_thread

from labkit.engine import EngineArgs, write_tiny_model
from labkit.engine.async_engine import AsyncLLMEngine
from labkit.process import ServerProcess, free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_engine_death_ends_streams_and_fails_health(tiny, monkeypatch):
    engine = AsyncLLMEngine(EngineArgs(tiny, max_model_len=256), served_model_name=MODEL)
    # The fault is in place before the request is sent: the model's fourth forward pass
    # raises, so the stream has its first three tokens and then dies, on any machine's speed
    # (a fault installed while the stream runs would race the 200 tokens to their end).
    forward, calls = engine.engine.model.forward, []

    def breaks_on_the_fourth_pass(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 4:
            raise RuntimeError("injected fault in the model")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.engine.model, "forward", breaks_on_the_fourth_pass)
    with serve_in_thread(engine) as base, httpx.Client(base_url=base, timeout=20) as http:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "injected fault" in error["message"]
        tokens = [json.loads(e)["choices"][0] for e in events[:-2]]
        assert len(tokens) == 3 and all(c["finish_reason"] is None for c in tokens)
        assert http.get("/health").status_code == 503
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503


SERVE_WITH_FAULT = textwrap.dedent("""
    import sys
    from labkit import cli
    from labkit.engine.model import LlamaModel

    forward, calls = LlamaModel.forward, []

    def forward_that_breaks(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("injected fault")
        return forward(self, *args, **kwargs)

    LlamaModel.forward = forward_that_breaks
    sys.exit(cli.main(sys.argv[1:]))
""")


def sigterm_takes_s(server: ServerProcess) -> float:
    """Send SIGTERM to the server alone (not its group) and time its exit (at most 5 s)."""
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=5)
    return time.monotonic() - start


def test_dead_server_exits_on_sigterm_and_honours_vllm_api_key(tiny, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    port = free_port()
    command = [sys.executable, "-c", SERVE_WITH_FAULT, "serve", tiny, "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "128"]
    with ServerProcess(command, f"http://127.0.0.1:{port}", startup_timeout_s=60) as server:
        base = server.base_url
        assert httpx.get(base + "/v1/models").status_code == 401
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
        response = httpx.post(base + "/v1/completions", json=body, timeout=20,
                              headers={"Authorization": "Bearer k"})
        assert response.status_code == 503, response.text
        assert httpx.get(base + "/health").status_code == 503
        assert sigterm_takes_s(server) < 5


# ``labkit serve`` whose streams hold after their first event, until the client goes away or
# the server stops: the stream is still open when SIGTERM comes, however fast the machine
# (a 1000-token stream might otherwise have ended). The hold is in the HTTP handler, not the
# engine, so stopping the engine waits out no step.
SERVE_HOLDING_STREAMS = textwrap.dedent("""
    import asyncio
    import sys
    from labkit import cli
    from labkit.engine.async_engine import AsyncLLMEngine

    generate = AsyncLLMEngine.generate

    async def held_after_the_first_output(self, *args, **kwargs):
        stream = generate(self, *args, **kwargs)
        try:
            yield await stream.__anext__()
            await asyncio.Event().wait()  # nothing sets it: held until cancelled
        finally:
            await stream.aclose()

    AsyncLLMEngine.generate = held_after_the_first_output
    sys.exit(cli.main(sys.argv[1:]))
""")


def test_sigterm_with_a_stream_open_exits_within_5_s(tiny):
    port = free_port()
    command = [sys.executable, "-c", SERVE_HOLDING_STREAMS, "serve", tiny, "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "1024"]
    with ServerProcess(command, f"http://127.0.0.1:{port}", startup_timeout_s=60) as server:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                          timeout=20) as response:
            lines = response.iter_lines()  # kept: a discarded iterator closes the stream
            next(line for line in lines if line.startswith("data: {"))
            assert sigterm_takes_s(server) < 5
