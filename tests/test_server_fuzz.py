"""A hostile but fair client: malformed, out-of-range and absurd requests against a running
server. None may cause a 5xx or a hang, every refusal is an OpenAI error object, and after
each one the server is healthy and serves a normal request."""

import json

import httpx
import pytest
from conftest import serve_tiny_model

from labkit.engine import write_tiny_model

MODEL = "tiny"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BAD_NUMBERS = [-1, 0, 1e-320, 1e308, -1e308, 2**64, -(2**63) - 1, "1", None, True, [],
               {"a": 1}, "NaN"]
MESSAGES = [{"role": "user", "content": "hi"}]


def _cases():
    """(path, raw body bytes) pairs: each a request a real client might send by mistake."""
    cases = []

    def add(path, body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        cases.append((path, raw))

    base = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    for field in ("temperature", "top_p", "top_k", "max_tokens", "n", "seed", "logprobs",
                  "min_tokens", "stop_token_ids"):
        for value in BAD_NUMBERS:
            add(COMPLETIONS, {**base, field: value})
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    for field in ("top_logprobs", "max_completion_tokens", "temperature"):
        for value in (-5, 10**9, "x", 1e-320):
            add(CHAT, {**chat, field: value, "logprobs": True})
    for prompt in ("", [], [-1], [2**40], [1.5], [[1, 2]], ["a", "b"], None, 17, {"x": 1},
                   "\U0001f600" * 300, "字" * 5000):
        add(COMPLETIONS, {**base, "prompt": prompt})
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                     "hi", [{"role": "user", "content": 5}]):
        add(CHAT, {**chat, "messages": messages})
    for stop in ([""], [1, 2], "x" * 10_000, [None]):
        add(COMPLETIONS, {**base, "stop": stop})
    for regex in ("(", "[\U0001f600]{3}", "a{100000000}", "(a{1000}){1000}", "(?<=x)y", "\\",
                  "(" * 1000 + "a" + ")" * 1000):
        add(COMPLETIONS, {**base, "regex": regex})
    for so in ({"json": {"type": "wibble"}}, {"grammar": "root ::= 'a'"}, {"nonsense": 1},
               {"choice": []}, {"regex": "a", "choice": ["a"]}, "yes",
               {"regex": "a{100000000}"}, {"json_object": True, "disable_any_whitespace": "no"},
               {"json": json.loads('{"properties": {"a": ' * 400 + "{}" + "}}" * 400)}):
        add(COMPLETIONS, {**base, "structured_outputs": so})
    for rf in ({"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema",
               "json_schema": {"schema": {"type": "object", "patternProperties": {}}}}, []):
        add(CHAT, {**chat, "response_format": rf})
    for extra in ({"best_of": 4}, {"logit_bias": {"1": 5}}, {"suffix": "x"},
                  {"presence_penalty": 1}, {"tools": [{"type": "function"}]},
                  {"stream_options": {"include_usage": True}}, {"model": "other"},
                  {"model": None}, {"echo": "maybe"}, {"n": 3, "temperature": 0, "seed": -7},
                  {"n": 2, "seed": 2**63 - 1}, {"stream": True, "prompt_logprobs": 1},
                  {"allowed_token_ids": [5]}, {"priority": -1},
                  {"stream": True, "stream_options": {"include_usage": True,
                                                      "continuous_usage_stats": True}}):
        add(COMPLETIONS, {**base, **extra})
    for extra in ({"echo": True}, {"chat_template": "{{ 1/0 }}"}, {"prompt_logprobs": 21},
                  {"continue_final_message": True}, {"add_special_tokens": "x"},
                  {"logprobs": True, "top_logprobs": 10**9}):
        add(CHAT, {**chat, **extra})
    for raw in (b"", b"{", b"[]", b"null", b'"str"', b"\xff\xfe", b'{"model": "tiny", '
                b'"prompt": "\\ud800"}', b'{"model": "tiny", "prompt": "a\\u0000b", '
                b'"max_tokens": 2}', b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                b'{"model": "tiny", "prompt": "x", "max_tokens": Infinity}',
                b'{"model": "\\ud800", "prompt": "x"}',  # quoted back in a 404's message
                b'{"model": "tiny", "prompt": "x", "structured_outputs": {"json": '
                b'{"type": "integer", "\\udc00": 1}}}'):  # named as the 400's param
        add(COMPLETIONS, raw)
    add(COMPLETIONS, {**base, "prompt": "x" * 5_000_000})   # past the request size limit
    add(COMPLETIONS, {**base, "top_k": 10**6, "temperature": 0.7})  # absurd but fair: 200
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    with serve_tiny_model(model_dir, MODEL, max_model_len=128, block_size=4) as running:
        yield running


def test_there_are_over_a_hundred_cases():
    assert len(CASES) >= 100
    assert len(set(CASES)) == len(CASES)


def test_no_request_breaks_the_server(server):
    base, engine = server
    normal = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    failures = []
    with httpx.Client(base_url=base, timeout=30) as http:
        for path, raw in CASES:
            response = http.post(path, content=raw, headers={"content-type": "application/json"})
            if response.status_code >= 500:
                failures.append((path, raw[:80], response.status_code, response.text[:200]))
                continue
            if response.status_code >= 400:
                error = response.json().get("error", {})
                if not (isinstance(error, dict) and error.get("message")
                        and error.get("code") == response.status_code
                        and error.get("type") and "param" in error):
                    failures.append((path, raw[:80], "not an OpenAI error", response.text[:200]))
            assert http.get("/health").status_code == 200, (path, raw[:80])
            assert http.post(COMPLETIONS, json=normal).status_code == 200, (path, raw[:80])
    assert not failures, failures
    assert not engine.engine.has_unfinished_requests()
    kv = engine.engine.kv_cache
    assert kv.block_pool.num_free_blocks == kv.num_blocks
