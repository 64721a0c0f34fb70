"""Property: whatever the prompt (multibyte included), seed and stop strings, the streamed
pieces add up to the non-streamed text, and both report the same usage and finish."""

import json

import httpx
import pytest
from conftest import serve_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.engine import write_tiny_model

MODEL = "tiny"
ALPHABET = st.sampled_from(list("abc xyz.,!?\néß字世界🎉😀ئ"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    with serve_tiny_model(model_dir, MODEL, max_model_len=256, block_size=4) as (url, _):
        yield url


def streamed(http, body):
    pieces, final, usage = [], None, None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}
                     ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                pieces.append(choice["text"])
                final = choice["finish_reason"] or final
    return "".join(pieces), final, usage


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(ALPHABET, min_size=1, max_size=12), seed=st.integers(0, 2**32),
       cut=st.tuples(st.integers(0, 40), st.integers(1, 4)),
       extra_stop=st.text(ALPHABET, min_size=1, max_size=3))
def test_stream_adds_up_to_the_final_text(base, prompt, seed, cut, extra_stop):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 1.0,
            "seed": seed, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30) as http:
        free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        # A stop string taken from the text itself, so that it does fire, and a random one.
        start, length = cut
        stop = [s for s in (free[start:start + length], extra_stop) if s]
        body["stop"] = stop
        whole = http.post("/v1/completions", json=body).json()
        text, finish, usage = streamed(http, body)
    assert text == whole["choices"][0]["text"]
    assert finish == whole["choices"][0]["finish_reason"]
    assert usage == whole["usage"]
    assert not any(s in text for s in stop)
    assert "\ufffd" not in text or "\ufffd" in free  # no half character leaks into a stream
