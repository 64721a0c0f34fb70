"""The OpenAI-compatible server: the official client, streaming, vLLM's parameters, errors,
metrics, authentication and limits, no leaks."""

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import serve_in_thread, serve_tiny_model
# Prometheus' own parser, not labkit.http.metrics: the pages are checked independently.
from prometheus_client.parser import text_string_to_metric_families

from labkit.engine import EngineArgs, write_tiny_model
from labkit.engine.async_engine import AsyncLLMEngine
from labkit.process import wait_until

openai = pytest.importorskip("openai")
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(tiny):
    with serve_tiny_model(tiny, MODEL, max_model_len=256, block_size=4) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def assert_no_leak(engine):
    """No request left and every KV block back. Aborts reach the engine's thread through its
    queue, so this waits for that first; the 30 s only bound a hang, the asserts below say
    what is left if it never gets there."""
    kv = engine.engine.kv_cache

    def clean() -> bool:
        return (not engine.engine.has_unfinished_requests() and not engine.engine.groups
                and kv.block_pool.num_free_blocks == kv.num_blocks and not kv.req_to_blocks)

    try:
        wait_until(clean, timeout_s=30, interval_s=0.02, what="no request left")
    except TimeoutError:
        pass  # the asserts name what is left
    assert not engine.engine.has_unfinished_requests() and not engine.engine.groups
    assert kv.block_pool.num_free_blocks == kv.num_blocks and not kv.req_to_blocks


class HeldModel:
    """The engine's model, held by the test: the first forward pass (the prefill that gives a
    request its first token) runs and sets ``reached``; every later one waits until
    ``release`` is set, so a request cannot finish, however fast the machine, before the
    test has done what it must do mid-flight. ``calls`` counts the passes. A wait that
    outlasts 30 s sets ``release`` itself: a broken test fails on its asserts, never hangs."""

    def __init__(self, engine: AsyncLLMEngine, monkeypatch) -> None:
        self.reached, self.release, self.calls = threading.Event(), threading.Event(), 0
        forward = engine.engine.model.forward

        def held(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                self.reached.set()
            elif not self.release.wait(30):
                self.release.set()
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.engine.model, "forward", held)


def closed_streams(engine: AsyncLLMEngine, monkeypatch) -> threading.Event:
    """An event set once a request's engine stream has been closed (finished or aborted:
    its ``finally`` queues the abort before this returns); the server's handlers call
    ``engine.generate`` at request time, so they get the wrapped one."""
    closed, generate = threading.Event(), engine.generate

    async def watched(*args, **kwargs):
        stream = generate(*args, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()
            closed.set()

    monkeypatch.setattr(engine, "generate", watched)
    return closed


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
    # OpenAI's newer name for the reply budget, and content given as text parts.
    chat = client.chat.completions.create(
        model=MODEL, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat.usage.completion_tokens == 3


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Paged attention", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == whole and len(pieces) == 8   # one chunk per token
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "hi"}],
                                          stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_add_special_tokens_and_chat_does_not(server, client):
    """As vLLM: a completion prompt is encoded with the tokenizer's special tokens (Llama's
    BOS), a chat prompt's template already holds them."""
    tokenizer = server[1].engine.tokenizer
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    assert done.usage.prompt_tokens == len(tokenizer.encode("Hello", add_special_tokens=True))
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages)
    rendered = tokenizer.apply_chat_template(messages)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_logprobs_are_raw_log_softmax(client, tiny):
    """The logprobs equal log_softmax of transformers' logits at the same positions: a
    reference we did not compute ourselves."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompt = [5, 17, 42]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                     logprobs=3, echo=True, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
    assert len(lp.tokens) == 3 + 4 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == done.choices[0].text
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits.double(), -1).numpy()
    np.testing.assert_allclose(lp.token_logprobs[1:3], [expected[0, 17], expected[1, 42]],
                               atol=1e-4)
    # Greedy picks the most likely token, so its logprob is the row's maximum.
    assert lp.token_logprobs[3] == pytest.approx(expected[2].max(), abs=1e-4)
    assert max(lp.top_logprobs[3].values()) == pytest.approx(expected[2].max(), abs=1e-4)


def test_chat_logprobs_shape(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True)
        assert len(item.top_logprobs) == 2 and item.logprob == item.top_logprobs[0].logprob
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_n_choices_share_the_prompt_and_equal_greedy(client):
    greedy = client.completions.create(model=MODEL, prompt="Tensor parallelism splits",
                                       max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    # vLLM refuses n > 1 at temperature 0 (n identical answers); top_k=1 is greedy too.
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy"):
        client.completions.create(model=MODEL, prompt="x", temperature=0, n=3)
    many = client.completions.create(model=MODEL, prompt="Tensor parallelism splits",
                                     max_tokens=6, temperature=1.0, n=3,
                                     extra_body={"ignore_eos": True, "top_k": 1})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(c.text == greedy.choices[0].text for c in many.choices)
    assert many.usage.completion_tokens == 18
    assert many.usage.prompt_tokens == greedy.usage.prompt_tokens
    streamed = client.completions.create(model=MODEL, prompt="Tensor parallelism splits",
                                         max_tokens=6, temperature=0.9, seed=3, n=2,
                                         stream=True, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    again = client.completions.create(model=MODEL, prompt="Tensor parallelism splits",
                                      max_tokens=6, temperature=0.9, seed=3, n=2,
                                      extra_body={"ignore_eos": True})
    assert texts == [c.text for c in again.choices]


def test_echo_returns_the_prompt_first(client):
    done = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3,
                                     echo=True, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].text == "Hello world" + plain.choices[0].text


def nested(kind: str, depth: int) -> dict:
    """A JSON schema ``depth`` objects (one required property each) or arrays deep."""
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = ({"type": "array", "items": schema} if kind == "array" else
                  {"type": "object", "properties": {"a": schema}, "required": ["a"]})
    return schema


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 10_000}, "n"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, "stop"),  # stalls all
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "word " * 400}, "input_tokens"),       # longer than max_model_len, as vLLM
    ({"prompt": "x", "max_tokens": 257}, "max_tokens"),  # more than max_model_len
    ({"prompt": [10**6]}, "prompt"),
    ({}, "prompt"),
    # vLLM parameters the teaching engine does not implement: refused, never ignored.
    ({"prompt": "x", "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": ["x"]}, "bad_words"),
    ({"prompt": "x", "priority": 1}, "priority"),
    ({"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True},
     "return_tokens_as_token_ids"),
    ({"prompt": "x", "logits_processors": ["my.Processor"]}, "logits_processors"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),  # as vLLM
    ({"prompt": "x", "structured_outputs": {"json_object": True,
                                            "disable_any_whitespace": "no"}},
     "disable_any_whitespace"),
    ({"prompt": "x", "structured_outputs": {"regex": "a{100000000}"}}, "regex"),
    # Patterns and schemas whose compiling or building would recurse too deeply, or grow
    # without bound (arrays double the regex at every level, optional properties square it).
    ({"prompt": "x", "regex": "(" * 1000 + "a" + ")" * 1000}, "regex"),
    ({"prompt": "x", "structured_outputs": {"json": nested("object", 400)}}, "json"),
    ({"prompt": "x", "structured_outputs": {"json": nested("array", 20)}}, "json"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(1000)}}}}, "json"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    response = httpx.post(server[0] + "/v1/completions", headers={"content-type":
                          "application/json"}, content=json.dumps({"model": MODEL, **body}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    assert error["param"] == param


def test_transport_errors_are_openai_errors(server, client):
    base = server[0]
    response = httpx.post(base + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        response = httpx.request(method, base + path)
        assert response.status_code == status
        assert response.json()["error"]["code"] == status
        if status == 405:  # RFC 9110: a 405 says which methods the resource allows
            assert response.headers["allow"] == ("POST" if path == "/v1/completions" else "GET")
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
    assert samples["vllm:generation_tokens_total"].labels == {"model_name": MODEL,
                                                              "engine": "0"}


def test_cancelled_streams_leak_no_blocks(server):
    base, engine = server

    async def cancel_midway(i):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 200,
                    "stream": True, "ignore_eos": True, "n": 1 + i % 3}
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
    assert_no_leak(engine)


def test_client_leaving_a_non_streamed_request_aborts_it(server, monkeypatch):
    """The client goes away once its request is in the engine (the first forward pass has
    run); the engine is held from its second pass until the server has closed the
    request's stream, so the request cannot run to its end first: it is aborted, every
    block of its eight choices comes back, and it stops after a few of its 240 steps."""
    base, engine = server
    model = HeldModel(engine, monkeypatch)
    closed = closed_streams(engine, monkeypatch)

    async def leave():
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            request = asyncio.ensure_future(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "long", "max_tokens": 240, "ignore_eos": True,
                "n": 8}))
            reached = await asyncio.to_thread(model.reached.wait, 30)
            request.cancel()  # the client walks away: httpx closes the connection
            await asyncio.wait({request})
        return reached

    try:
        assert asyncio.run(leave()), "the request never reached the engine"
        assert closed.wait(30), "the server did not notice the client leave"
    finally:
        model.release.set()
    assert_no_leak(engine)
    assert model.calls < 240  # aborted, not run to its end


def test_regex_and_structured_outputs_through_the_api(client):
    import regex

    done = client.completions.create(model=MODEL, prompt="Call", max_tokens=20,
                                     extra_body={"regex": r"\+1 [0-9]{3} [0-9]{4}"})
    assert regex.fullmatch(r"\+1 [0-9]{3} [0-9]{4}", done.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="invalid pattern"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"regex": "(oops"})
    choice = client.completions.create(
        model=MODEL, prompt="Pick", max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert isinstance(json.loads(reply.choices[0].message.content)["ok"], bool)


def test_api_key_protects_v1_routes(tiny):
    engine = AsyncLLMEngine(EngineArgs(tiny, max_model_len=64), served_model_name=MODEL)
    with serve_in_thread(engine, api_key="s3cret") as base:
        assert httpx.get(base + "/v1/models").status_code == 401
        wrong = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
        assert wrong.headers["www-authenticate"] == "Bearer"  # RFC 9110: how to authenticate
        right = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert httpx.get(base + "/health").status_code == 200   # probes need no key
        assert httpx.get(base + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope").models.list()


def test_request_size_limit(tiny):
    engine = AsyncLLMEngine(EngineArgs(tiny, max_model_len=64), served_model_name=MODEL)
    with serve_in_thread(engine, max_request_bytes=10_000) as base:
        big = {"model": MODEL, "prompt": "x" * 20_000}
        response = httpx.post(base + "/v1/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == 413

        def chunks():  # no Content-Length: the limit counts what arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(30):
                yield b"x" * 1000
            yield b'"}'

        response = httpx.post(base + "/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"})
        assert response.status_code == 413
        ok = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                        "max_tokens": 2})
        assert ok.status_code == 200


def test_tokenization_runs_off_the_engine_thread(server, monkeypatch):
    engine = server[1]
    seen = []
    tokenizer = engine.engine.tokenizer
    original = tokenizer.encode

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "hello",
                                                    "max_tokens": 1})
    assert seen and "engine-loop" not in seen


def stream_choices(http, path, body):
    """A streamed request's choices put back together: text, and the logprobs lists."""
    choices = {}
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                whole = choices.setdefault(c["index"], {"text": "", "logprobs": {}})
                whole["text"] += c["text"]
                for key, values in (c["logprobs"] or {}).items():
                    whole["logprobs"].setdefault(key, []).extend(values)
    return [choices[i] for i in sorted(choices)]


@pytest.mark.parametrize("body", [
    {"prompt": "字字 😀 ok", "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0},
    {"prompt": [0, 5, 17, 42], "logprobs": 2, "max_tokens": 12, "temperature": 0.8,
     "seed": 3, "n": 2},
    {"prompt": "Hello world", "logprobs": 0, "max_tokens": 20, "temperature": 1.0, "seed": 5,
     "stop": ["e "], "echo": True},
])
def test_streamed_logprobs_add_up_to_the_non_streamed_ones(server, body):
    """Tokens, logprobs and text_offset of every chunk, put together, are the non-streamed
    response's, also where text is held back (a multi-byte character, a possible stop)."""
    body = {"model": MODEL, "ignore_eos": True, **body}
    with httpx.Client(base_url=server[0], timeout=30) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"]
        streamed = stream_choices(http, "/v1/completions", body)
    assert [c["text"] for c in streamed] == [c["text"] for c in whole]
    assert [c["logprobs"] for c in streamed] == [c["logprobs"] for c in whole]


def test_chat_errors_name_the_chat_field(server):
    """Chat fields that feed an engine parameter under another name are named as sent."""
    cases = [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"max_completion_tokens": 0}, "max_completion_tokens"),
             ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
             ({"max_tokens": 10**6}, "max_tokens"),
             ({"messages": [{"role": "user", "content": "word " * 400}]}, "input_tokens"),
             ({"echo": True}, "echo"), ({"chat_template": "{{ messages }}"}, "chat_template"),
             ({"continue_final_message": True}, "continue_final_message"),
             ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
             ({"stream": True, "prompt_logprobs": 2}, "prompt_logprobs")]
    for fields, param in cases:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
        response = httpx.post(server[0] + "/v1/chat/completions", json=body)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (fields, error)
        assert error["message"].startswith(param) or "context length" in error["message"]


def test_chat_prompt_logprobs_and_add_special_tokens(server, client):
    """vLLM's chat extras: ``prompt_logprobs`` (top level of the response) and
    ``add_special_tokens`` (a BOS before the rendered template)."""
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    extra = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"prompt_logprobs": 1, "add_special_tokens": True})
    assert extra.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    prompt_logprobs = extra.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == extra.usage.prompt_tokens and prompt_logprobs[0] is None
    assert all(len(entry) in (1, 2) for entry in prompt_logprobs[1:])
    assert plain.model_extra["prompt_logprobs"] is None


def test_continuous_usage_stats(server):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so
    far of its choice; the last, as with ``include_usage`` alone, the request's."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with httpx.Client(base_url=server[0], timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        index = chunk["choices"][0]["index"]
        seen[index] += 1
        assert chunk["usage"]["completion_tokens"] == seen[index]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and not chunks[-1]["choices"]


def test_a_client_leaving_a_non_streamed_request_is_no_server_error(server, monkeypatch):
    """When a non-streamed request's client goes away, the request is aborted and the
    handler returns quietly (closing the engine stream while it still runs would raise)."""
    from labkit.engine.sampling import SamplingParams
    from labkit.engine.server import _collect

    engine = server[1]
    # The request is still running at the second look, on any machine: the engine is held
    # after its first pass until _collect has returned (and queued the abort).
    model = HeldModel(engine, monkeypatch)

    class Gone:  # there for the first look, gone by the second: the request is running
        looks = 0

        async def is_disconnected(self):
            self.looks += 1
            return self.looks > 1

    async def leave():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate("Hello", params, "gone")
        first = await stream.__anext__()
        try:
            return await _collect(stream, first, Gone())
        finally:
            model.release.set()

    assert asyncio.run(leave()) is None
    assert_no_leak(engine)
    assert model.calls < 200  # aborted, not run to its end


def test_shutdown_does_not_wait_out_a_slow_step(tiny, monkeypatch):
    """SIGTERM must stop the server within 5 s, 2 s of which uvicorn's graceful shutdown
    takes: stopping the engine may not wait for a step that takes seconds (a slow
    constraint), which finishes in its daemon thread instead. The step here is held until
    the test lets it go, after shutdown() has returned (60 s at most): a shutdown that
    waited for it would take the whole minute. 10 s bounds the 2 s join on any machine."""
    from labkit.engine.sampling import SamplingParams

    engine = AsyncLLMEngine(EngineArgs(tiny, max_model_len=64), served_model_name=MODEL)
    forward, stepping, release = engine.engine.model.forward, threading.Event(), \
        threading.Event()

    def held_forward(*args, **kwargs):
        stepping.set()
        release.wait(60)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.engine.model, "forward", held_forward)

    async def one_token():
        await engine.generate("Hello", SamplingParams(max_tokens=1)).__anext__()

    threading.Thread(target=asyncio.run, args=(one_token(),), daemon=True).start()
    try:
        assert stepping.wait(30)
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 10
        assert engine._thread.is_alive()  # noqa: SLF001 - the step still held, left behind
    finally:
        release.set()


def test_a_template_refusal_names_messages_once(tiny, tmp_path):
    """A chat template that rejects the conversation (Llama 2's raise_exception on roles out
    of turn) is a 400 for messages, its message said once."""
    import shutil
    from pathlib import Path

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(Path(tiny, name), tmp_path / name)
    config = json.loads(Path(tiny, "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] != 'user' %}"
                               "{{ raise_exception('Conversations must start with a user') }}"
                               "{% endif %}{{ messages[0]['content'] }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = AsyncLLMEngine(EngineArgs(str(tmp_path), max_model_len=64), served_model_name=MODEL)
    with serve_in_thread(engine) as base:
        response = httpx.post(base + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages"
    assert error["message"] == ("messages: the chat template rejected them: Conversations "
                                "must start with a user")
