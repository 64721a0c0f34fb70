"""The OpenAI-compatible server: the official client, streaming, errors, metrics, no leaks."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from labkit.engine import EngineArgs, write_tiny_model
from labkit.engine.async_engine import AsyncLLMEngine
from labkit.engine.server import build_app

openai = pytest.importorskip("openai")
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    engine = AsyncLLMEngine(EngineArgs(str(model_dir), max_model_len=256, block_size=4),
                            served_model_name=MODEL)
    port = free_port()
    config = uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="error")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield base, engine
    uv.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_completion_and_chat(client):
    done = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 5 and done.usage.prompt_tokens > 0
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Paged attention", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == whole and len(pieces) == 8
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "hi"}],
                                          stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "word " * 400}, None),             # longer than max_model_len
    ({}, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    response = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    assert error["param"] == param


def test_malformed_json_unknown_model_and_client_errors(server, client):
    response = httpx.post(server[0] + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 400)


def test_metrics_parse_with_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(server[0] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"):
        assert name in families, name
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["vllm:generation_tokens_total"].value >= 3
    assert samples["vllm:time_to_first_token_seconds_count"].value >= 1
    assert samples["vllm:generation_tokens_total"].labels == {"model_name": MODEL}


def test_cancelled_streams_leak_no_blocks(server):
    base, engine = server

    async def cancel_midway(i):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 200,
                    "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[6:])
                        seen += 1
                    if seen == 3 + i % 4:
                        break  # the client walks away mid-stream

    async def load():
        await asyncio.gather(*(cancel_midway(i) for i in range(12)))

    asyncio.run(load())
    wait_idle(engine)
    kv = engine.engine.kv_cache
    assert not engine.engine.has_unfinished_requests()
    assert kv.block_pool.num_free_blocks == kv.num_blocks and not kv.req_to_blocks


def test_regex_through_the_api(client):
    import regex

    done = client.completions.create(model=MODEL, prompt="Call", max_tokens=20,
                                     extra_body={"regex": r"\+1 [0-9]{3} [0-9]{4}"})
    assert regex.fullmatch(r"\+1 [0-9]{3} [0-9]{4}", done.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="invalid pattern"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"regex": "(oops"})
