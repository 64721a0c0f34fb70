"""Structured outputs on the real engine beside the teaching engine: vLLM's CPU build (the
guidance backend) and ``labkit serve`` get the same schemas and requests, and every answer of
both parses strictly and is valid for its schema.

Every schema says ``"additionalProperties": false``. JSON Schema allows undeclared properties
by default, and vLLM's backends let the model write them, so a random model fills the document
with made-up keys until ``max_tokens``; the teaching engine never writes undeclared properties
(as outlines). A schema meant for a model's answer should say what it allows.
"""

import json

import httpx
import jsonschema
import pytest

from labkit.harness.lab_engines import lab_model, start_server
from labkit.lab import detect
from labkit.launch import ServeConfig
from labkit.process import free_port

pytestmark = pytest.mark.real_engine  # starts its own vLLM server

#: guidance, with no whitespace between tokens: a random model given the freedom pads JSON
#: with whitespace until max_tokens.
GUIDANCE = '{"backend": "guidance", "disable_any_whitespace": true}'

SCHEMAS = {
    "person": {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer"},
                              "colors": {"type": "array", "items": {"enum": ["red", "green"]},
                                         "maxItems": 3},
                              "ok": {"type": "boolean"}},
               "required": ["name", "age"], "additionalProperties": False},
    "verdict": {"type": "object",
                "properties": {"verdict": {"enum": ["approve", "reject", "escalate"]},
                               "score": {"type": "integer"}},
                "required": ["verdict", "score"], "additionalProperties": False},
    "nested": {"type": "object",
               "properties": {"order": {"type": "object",
                                        "properties": {"id": {"type": "integer"},
                                                       "paid": {"type": "boolean"}},
                                        "required": ["id", "paid"],
                                        "additionalProperties": False},
                              "tags": {"type": "array", "items": {"type": "boolean"},
                                       "maxItems": 2}},
               "required": ["order"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def servers():
    path = detect()
    if path.runs("vllm") != "cpu":
        pytest.skip("vLLM's CPU build is not installed here (make vllm-env)")
    started = []
    try:
        for engine, extra in (("vllm", ("--structured-outputs-config", GUIDANCE)),
                              ("labkit", ())):
            cfg = ServeConfig(model=lab_model(engine, path), port=free_port(),
                              served_model_name="course-model", max_model_len=1024,
                              extra_args=extra)
            started.append((engine, cfg.base_url, start_server(engine, cfg, path)))
        yield {engine: url for engine, url, _ in started}
    finally:
        for _, _, server in started:
            server.stop()


@pytest.mark.parametrize("name", SCHEMAS)
def test_both_engines_write_json_valid_for_the_schema(servers, name):
    schema = SCHEMAS[name]
    for engine, url in servers.items():
        for seed in range(3):
            body = {"model": "course-model", "prompt": f"Answer as JSON ({name}):",
                    "max_tokens": 200, "temperature": 1.0, "seed": seed,
                    "structured_outputs": {"json": schema}}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=120,
                                trust_env=False)
            assert answer.status_code == 200, (engine, answer.text)
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (engine, seed, choice["text"])
            jsonschema.validate(json.loads(choice["text"]), schema)  # strict: no raw controls
