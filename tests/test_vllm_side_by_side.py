"""The teaching engine held against real vLLM (its CPU build) over HTTP (DESIGN: three paths).

Both servers serve the same model directory, labkit's tiny Llama with a real tokenizer, as
``course-model`` with a 1024-token context: vLLM is the test run's shared server
(``shared_vllm``; these tests skip where vLLM's CPU build is not installed) and the teaching
engine runs in this process with vLLM's block size. The same requests go to both through the
official ``openai`` client and httpx, and the answers are compared: texts and logprobs, the
response fields and streaming chunks, the errors for bad requests, and the Prometheus metrics.

Where labkit differs from vLLM on purpose, :data:`DIFFERENCES` says why in one line and a test
checks that the difference still holds, so a difference that disappears, or one that appears
unannounced, fails.

vLLM on CPU runs this float32 checkpoint in bfloat16, the teaching engine in float32, so
logprobs agree to :data:`LOGPROB_ATOL`, not exactly. The tiny model's weights are random and
its next-token distribution nearly flat: at many steps the two best tokens are less than 0.01
apart, and there bfloat16 may pick the other one. Greedy texts are compared on prompts whose
first :data:`GREEDY_TOKENS` steps all have a clear winner in labkit. Which prompts those are
depends on the token ids, so on the ``tokenizers`` release that trained the tiny model's
vocabulary: the ``greedy`` fixture picks them from candidate pools at run time, with labkit
alone, and fails if a pool has too few.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from conftest import serve_tiny_model
# Prometheus' own parser, not labkit.http.metrics: the pages are checked independently.
from prometheus_client.parser import text_string_to_metric_families

from labkit.harness.lab_engines import lab_model
from labkit.http.metrics import sample_totals
from labkit.process import wait_until

openai = pytest.importorskip("openai")

MODEL = "course-model"
MAX_MODEL_LEN = 1024
# How far apart the two engines' logprobs of one token may be: bfloat16 keeps 8 significant
# bits, about 0.4 % of a logprob near -6 (measured: at most 0.005 apart).
LOGPROB_ATOL = 0.01
# A step's two best tokens further apart than this in labkit are ranked alike by any engine
# whose logprobs are within LOGPROB_ATOL of labkit's: the greedy choice cannot differ.
CLEAR_GAP = 2 * LOGPROB_ATOL
GREEDY_TOKENS = 8
# Measured with tokenizers 0.23: about one prompt in eight has a clear winner at each of its
# first 8 steps; the pools hold enough that PER_POOL are found with a wide margin.
PER_POOL = 2
CANDIDATES = {
    "ascii": ["Paged attention splits it into blocks", "Tensor parallelism splits each layer",
              "Large language model inference is limited", "The key value cache stores",
              "Quantization stores weights", "A scheduler batches requests",
              "Serving engines such as vLLM", "The quick brown fox", "What is the capital",
              "One, two, three,", "Hello world!", "Finished sequences leave",
              "A token budget bounds every step", "Memory bandwidth when decoding",
              "Compute when prefilling a long prompt", "Two all-reduce operations per layer",
              "Eight or four bits", "Streaming, health checks and metrics",
              "The lazy dog sleeps", "Paris is the capital of France",
              "Waiting ones join the batch", "Blocks of sixteen tokens",
              "An OpenAI compatible HTTP API", "Keeps the activations in sixteen"],
    "multibyte": ["Größe: 東京 → 北京 🚀", "数据中心的GPU", "naïve café – déjà vu",
                  "Über 北京 — ☃", "Ça coûte 5 € ou 3 ¥", "Привет, мир", "こんにちは世界",
                  "🚀 launches at dawn", "显存不够用了", "张量并行与流水线并行", "连续批处理",
                  "Καλημέρα κόσμε", "مرحبا بالعالم", "한국어 텍스트", "Emoji 🙂 and 🎉",
                  "Straße und Maß", "año, niño, señor", "Tiếng Việt có dấu", "Zürich – München",
                  "½ + ¼ = ¾", "∑ x² ≤ ∞", "naïve résumé", "El Niño → 🌊", "推理服务的吞吐量"],
}

#: Where labkit and vLLM 0.32 (CPU) answer differently on purpose, one line each.
DIFFERENCES = {
    "penalties": "labkit refuses presence/frequency/repetition penalties with a 400 (the "
                 "teaching engine does not implement them); vLLM applies them",
    "best_of": "labkit refuses best_of > 1 (not implemented); vLLM 0.32 accepts it",
    "guided": "labkit refuses guided_* with a 400 pointing to structured_outputs (vLLM 0.33 "
              "removed them); vLLM 0.32 ignores them",
    "prompt_list": "labkit refuses a list of prompts (one request per prompt); vLLM batches it",
    "custom_role": "labkit accepts OpenAI's roles only; vLLM passes any role to the template",
    "validation_error": "labkit reports a malformed body as BadRequestError naming the field "
                        "(max_tokens); vLLM as 'Bad Request' with param body.max_tokens",
    "chat_param": "labkit's param names the chat field the client sent (top_logprobs, "
                  "max_completion_tokens); vLLM's the sampling parameter (logprobs, max_tokens)",
    "route_errors": "labkit answers unknown routes and methods with an OpenAI error object; "
                    "vLLM with FastAPI's {'detail': ...}",
    "body_limit": "labkit refuses bodies over 4 MiB with a 413 before parsing; vLLM has no "
                  "limit and parses them",
    "partial_utf8_token": "a logprob token that ends inside a UTF-8 character is U+FFFD in "
                          "labkit (its own bytes); vLLM guesses it from the tokens around it",
    "vllm_extensions": "vLLM adds fields of its own (system_fingerprint, token_ids, "
                       "kv_transfer_params, ...) that labkit does not send",
}


def case(name: str, endpoint: str, body: dict, difference: str | None = None):
    """One bad request: the body (``model`` added unless given; ``None`` leaves it out), and
    the key of its entry in :data:`DIFFERENCES` where labkit answers otherwise on purpose."""
    return pytest.param(endpoint, body, difference, id=name)


_X = {"messages": [{"role": "user", "content": "x"}]}
ERROR_CASES = [
    case("negative temperature", "completions", {"prompt": "x", "temperature": -1}),
    case("top_p 2", "completions", {"prompt": "x", "top_p": 2}),
    case("top_p 0", "completions", {"prompt": "x", "top_p": 0}),
    case("max_tokens 0", "completions", {"prompt": "x", "max_tokens": 0}),
    case("n 0", "completions", {"prompt": "x", "n": 0}),
    case("logprobs 21", "completions", {"prompt": "x", "logprobs": 21}),
    case("logprobs -1", "completions", {"prompt": "x", "logprobs": -1}),
    case("min_tokens over max_tokens", "completions",
         {"prompt": "x", "min_tokens": 5, "max_tokens": 2}),
    case("empty stop string", "completions", {"prompt": "x", "stop": [""]}),
    case("token id out of vocabulary", "completions", {"prompt": [10**6]}),
    case("missing prompt", "completions", {}),
    case("unknown model", "completions", {"prompt": "x", "model": "gpt-9"}),
    case("stream_options without stream", "completions",
         {"prompt": "x", "stream_options": {"include_usage": True}}),
    case("chat: no messages", "chat/completions", {"messages": []}),
    case("chat: negative temperature", "chat/completions", {**_X, "temperature": -1}),
    case("chat: max_tokens 0", "chat/completions", {**_X, "max_tokens": 0}),
    case("chat: max_completion_tokens 0", "chat/completions",
         {**_X, "max_completion_tokens": 0}, "chat_param"),
    case("chat: top_logprobs without logprobs", "chat/completions", {**_X, "top_logprobs": 2}),
    case("chat: top_logprobs 21", "chat/completions",
         {**_X, "logprobs": True, "top_logprobs": 21}, "chat_param"),
    case("chat: unknown model", "chat/completions", {**_X, "model": "gpt-9"}),
    case("presence_penalty", "completions", {"prompt": "x", "presence_penalty": 0.5},
         "penalties"),
    case("repetition_penalty", "completions", {"prompt": "x", "repetition_penalty": 1.2},
         "penalties"),
    case("best_of 3", "completions", {"prompt": "x", "best_of": 3}, "best_of"),
    case("guided_regex", "completions", {"prompt": "x", "guided_regex": "a+"}, "guided"),
    case("list of prompts", "completions", {"prompt": ["a", "b"]}, "prompt_list"),
    case("chat: custom role", "chat/completions",
         {"messages": [{"role": "robot", "content": "x"}]}, "custom_role"),
    case("max_tokens not a number", "completions", {"prompt": "x", "max_tokens": "many"},
         "validation_error"),
    case("seed over 64 bits", "completions", {"prompt": "x", "seed": 2**64}, "validation_error"),
    case("prompt over max_model_len", "completions", {"prompt": [5] * 1025}),
    case("prompt + max_tokens over max_model_len", "completions",
         {"prompt": [5] * 1000, "max_tokens": 100}),
    case("max_tokens over max_model_len", "completions", {"prompt": "x", "max_tokens": 2000}),
    case("chat: reply longer than the context leaves", "chat/completions",
         {**_X, "max_tokens": 1020}),
    case("no model", "completions", {"prompt": "x", "model": None}),
    case("n 2 at temperature 0", "completions", {"prompt": "x", "n": 2, "temperature": 0}),
]


# -- the two servers ----------------------------------------------------------------------

def scrape(base: str) -> dict:
    """``/metrics`` parsed with prometheus_client: family name -> family."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def bases(shared_vllm):
    """Base URLs by engine: ``{"vllm": ..., "labkit": ...}``, both serving ``MODEL``."""
    _, cfg = shared_vllm
    # vLLM's KV-cache block size on this machine (128 on CPU): prefix-cache hits count whole
    # blocks, so the teaching engine takes the same one.
    info = scrape(cfg.base_url)["vllm:cache_config_info"].samples[0].labels
    with serve_tiny_model(lab_model("vllm"), MODEL, max_model_len=MAX_MODEL_LEN,
                          block_size=int(info["block_size"])) as (base, _):
        yield {"vllm": cfg.base_url, "labkit": base}


@pytest.fixture(scope="module")
def clients(bases):
    return {name: openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            for name, base in bases.items()}


def clear_steps(best_two: list[list[float]]) -> int:
    """How many leading steps have two best logprobs more than CLEAR_GAP apart in labkit."""
    for step, pair in enumerate(best_two):
        if len(pair) < 2 or pair[0] - pair[1] <= CLEAR_GAP:
            return step
    return len(best_two)


#: Steps of the greedy paths the tests that compare logprob tokens one by one generate.
TOKEN_STEPS = 3


@pytest.fixture(scope="module")
def greedy(clients) -> dict[str, list]:
    """Prompts and conversations whose greedy path has a clear winner at each of its first
    GREEDY_TOKENS steps in labkit: ``{"ascii": [prompt, ...], "multibyte": [...],
    "chat-ascii": [messages, ...], "chat-multibyte": [...]}``, PER_POOL of each, in pool
    order; and under ``"whole"`` ASCII prompts whose first TOKEN_STEPS steps are clear and
    end on whole characters, for the tests that compare logprob tokens one by one (a token
    that ends inside a character differs on purpose: ``partial_utf8_token``)."""
    ours = clients["labkit"]

    def clear(steps: int = GREEDY_TOKENS, whole: bool = False, **request) -> bool:
        request.update(model=MODEL, max_tokens=steps, temperature=0,
                       extra_body={"ignore_eos": True})
        if "messages" in request:
            answer = ours.chat.completions.create(logprobs=True, top_logprobs=2, **request)
            content = answer.choices[0].logprobs.content
            best_two = [[t.logprob for t in item.top_logprobs] for item in content]
            tokens = [item.token for item in content]
        else:
            answer = ours.completions.create(logprobs=2, **request)
            best_two = [sorted(top.values(), reverse=True)[:2]
                        for top in answer.choices[0].logprobs.top_logprobs]
            tokens = answer.choices[0].logprobs.tokens
        return clear_steps(best_two) == steps and not (whole and "\ufffd" in "".join(tokens))

    def pick(name: str, candidates, **conditions) -> list:
        found = [c for c in candidates if clear(**conditions, **c)][:PER_POOL]
        if len(found) < PER_POOL:
            pytest.fail(f"only {len(found)} candidates for {name!r} have a clear greedy path: "
                        f"add candidates")
        return [c.get("prompt", c.get("messages")) for c in found]

    picked: dict[str, list] = {}
    for kind, pool in CANDIDATES.items():
        picked[kind] = pick(kind, [{"prompt": p} for p in pool])
        picked[f"chat-{kind}"] = pick(f"chat-{kind}", [
            {"messages": [{"role": "user", "content": p}]} for p in pool])
    picked["whole"] = pick("whole", [{"prompt": p} for p in CANDIDATES["ascii"]],
                           steps=TOKEN_STEPS, whole=True)
    picked["chat-whole"] = pick("chat-whole", [
        {"messages": [{"role": "user", "content": p}]} for p in CANDIDATES["ascii"]],
        steps=TOKEN_STEPS, whole=True)
    return picked


def both(clients, method: str, **kwargs) -> tuple:
    """The same ``openai`` call against vLLM and labkit: ``(vllm_answer, labkit_answer)``."""
    answers = []
    for name in ("vllm", "labkit"):
        api = clients[name].chat.completions if method == "chat" else clients[name].completions
        answers.append(api.create(model=MODEL, **kwargs))
    return tuple(answers)


def post_both(bases, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    return tuple(httpx.post(bases[name] + path, json=body, timeout=60)
                 for name in ("vllm", "labkit"))


def close(theirs: list, ours: list) -> None:
    """Logprobs equal within the bfloat16 tolerance; ``None`` where both have none."""
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a == pytest.approx(b, abs=LOGPROB_ATOL)


def assert_fields_subset(ours, theirs, where: str = "response") -> None:
    """Every field labkit sends, vLLM sends too, with the same JSON type, recursively (vLLM
    may send more: its extensions). Values are not compared: ids, timestamps and sampled
    texts differ by design."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), f"{where}: labkit sends an object, vLLM {theirs!r}"
        extra = set(ours) - set(theirs)
        assert not extra, f"{where}: labkit sends {sorted(extra)}, which vLLM does not"
        for key, value in ours.items():
            assert_fields_subset(value, theirs[key], f"{where}.{key}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_fields_subset(a, b, f"{where}[{i}]")
    elif isinstance(ours, bool) or ours is None or isinstance(ours, str):
        assert type(ours) is type(theirs), f"{where}: {ours!r} against vLLM's {theirs!r}"
    else:
        assert isinstance(ours, int | float) and isinstance(theirs, int | float), where
        assert isinstance(ours, int) == isinstance(theirs, int), f"{where}: int against float"


def sse(base: str, path: str, body: dict) -> list[dict]:
    """A streamed response's ``data:`` payloads, ``[DONE]`` checked and left out."""
    with httpx.stream("POST", base + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    return [json.loads(line) for line in lines[:-1]]


# -- greedy texts and logprobs --------------------------------------------------------------

SLOTS = [(kind, i) for kind in CANDIDATES for i in range(PER_POOL)]
SLOT_IDS = [f"{kind}-{i}" for kind, i in SLOTS]


@pytest.mark.parametrize("kind, i", SLOTS, ids=SLOT_IDS)
def test_greedy_completions_and_logprobs_agree(clients, greedy, kind, i):
    vllm, ours = both(clients, "completions", prompt=greedy[kind][i],
                      max_tokens=GREEDY_TOKENS, temperature=0, logprobs=2,
                      extra_body={"ignore_eos": True})
    a, b = vllm.choices[0], ours.choices[0]
    assert b.text == a.text
    assert ours.usage == vllm.usage
    close(a.logprobs.token_logprobs, b.logprobs.token_logprobs)
    for theirs, mine in zip(a.logprobs.top_logprobs, b.logprobs.top_logprobs, strict=True):
        shared = theirs.keys() & mine.keys()
        close([theirs[t] for t in shared], [mine[t] for t in shared])


@pytest.mark.parametrize("kind, i", SLOTS, ids=SLOT_IDS)
def test_greedy_chat_replies_and_logprobs_agree(clients, greedy, kind, i):
    vllm, ours = both(clients, "chat", messages=greedy[f"chat-{kind}"][i],
                      max_tokens=GREEDY_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
                      extra_body={"ignore_eos": True})
    a, b = vllm.choices[0], ours.choices[0]
    assert b.message.content == a.message.content and b.message.role == a.message.role
    assert ours.usage == vllm.usage
    close([t.logprob for t in a.logprobs.content], [t.logprob for t in b.logprobs.content])


def test_prompt_logprobs_of_an_echoed_prompt_agree(clients, greedy):
    vllm, ours = both(clients, "completions", prompt=greedy["whole"][0],
                      max_tokens=TOKEN_STEPS, temperature=0, echo=True, logprobs=1)
    a, b = vllm.choices[0].logprobs, ours.choices[0].logprobs
    assert ours.choices[0].text == vllm.choices[0].text
    assert b.tokens == a.tokens and b.text_offset == a.text_offset
    close(a.token_logprobs, b.token_logprobs)


@pytest.mark.parametrize("include", [False, True], ids=["stop-cut", "stop-included"])
def test_stop_strings_end_both_at_the_same_place(clients, greedy, include):
    prompt = greedy["multibyte"][0]
    full, _ = both(clients, "completions", prompt=prompt, max_tokens=GREEDY_TOKENS,
                   temperature=0)
    text = full.choices[0].text
    stop = text[6:9]  # from the middle of the greedy text both engines write
    vllm, ours = both(clients, "completions", prompt=prompt, max_tokens=GREEDY_TOKENS,
                      temperature=0, stop=[stop, "never appears"],
                      extra_body={"include_stop_str_in_output": include})
    cut = text.index(stop) + (len(stop) if include else 0)
    for answer in (vllm, ours):
        choice = answer.choices[0]
        assert (choice.text, choice.finish_reason, choice.stop_reason) == (text[:cut], "stop",
                                                                           stop)
    assert ours.usage == vllm.usage


def test_finish_reasons_and_usage_agree(clients):
    vllm, ours = both(clients, "completions", prompt="One, two, three,", max_tokens=5,
                      temperature=0)
    assert (ours.choices[0].finish_reason, ours.choices[0].stop_reason) == \
        (vllm.choices[0].finish_reason, vllm.choices[0].stop_reason) == ("length", None)
    assert ours.usage.model_dump(exclude_none=True) == vllm.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": vllm.usage.prompt_tokens, "completion_tokens": 5,
        "total_tokens": vllm.usage.prompt_tokens + 5}


def test_n_choices_have_the_same_shape(clients):
    """Sampled choices differ (different random generators), their structure does not."""
    vllm, ours = both(clients, "completions", prompt="Tensor parallelism splits", n=3,
                      max_tokens=4, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    for answer in (vllm, ours):
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert {c.finish_reason for c in answer.choices} == {"length"}
    assert ours.usage == vllm.usage and ours.usage.completion_tokens == 12


# -- response fields and streaming ----------------------------------------------------------

def test_response_fields_are_a_subset_of_vllms(bases, greedy):
    # logprobs 0: the top alternatives are keyed by token, and only the sampled (greedy) ones
    # are sure to be the same tokens in both engines.
    prompt, messages = greedy["whole"][0], greedy["chat-whole"][0]
    for path, body in (("/v1/completions", {"prompt": prompt, "logprobs": 0}),
                       ("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 0}),
                       ("/v1/chat/completions", {"messages": messages, "logprobs": True,
                                                 "top_logprobs": 0})):
        body = {"model": MODEL, "max_tokens": TOKEN_STEPS, "temperature": 0, **body}
        theirs, ours = (r.json() for r in post_both(bases, path, body))
        assert_fields_subset(ours, theirs)
        assert set(theirs) - set(ours), DIFFERENCES["vllm_extensions"]
        prefix = "chatcmpl-" if "chat" in path else "cmpl-"
        for answer in (theirs, ours):
            assert re.fullmatch(prefix + "[0-9a-f]+", answer["id"]), answer["id"]
            assert isinstance(answer["created"], int)
            assert answer["object"] == ("chat.completion" if "chat" in path
                                        else "text_completion")


def _streams(bases, path: str, body: dict) -> tuple[list[dict], list[dict]]:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **body}
    return sse(bases["vllm"], path, body), sse(bases["labkit"], path, body)


def _check_stream(theirs: list[dict], ours: list[dict], text_of) -> None:
    """Same number of chunks, same pieces, one id, the finish reason on the last choice
    chunk only, then a usage chunk without choices."""
    assert len(ours) == len(theirs)
    assert [text_of(c) for c in ours[:-1]] == [text_of(c) for c in theirs[:-1]]
    for chunks in (theirs, ours):
        assert len({c["id"] for c in chunks}) == 1
        reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
        assert reasons == [None] * (len(reasons) - 1) + ["length"]
        assert chunks[-1]["choices"] == []
    assert ours[-1]["usage"] == {k: theirs[-1]["usage"][k] for k in ours[-1]["usage"]}


def test_completion_stream_chunks_agree(bases, greedy):
    theirs, ours = _streams(bases, "/v1/completions", {"prompt": greedy["ascii"][0]})
    _check_stream(theirs, ours, lambda c: c["choices"][0]["text"])
    assert len(ours) == 6 + 1  # one chunk per token, then usage
    for mine, their in zip(ours, theirs, strict=True):
        assert_fields_subset(mine, their, "chunk")
        assert mine["object"] == their["object"] == "text_completion"


def test_chat_stream_chunks_agree(bases, greedy):
    theirs, ours = _streams(bases, "/v1/chat/completions", {"messages": greedy["chat-ascii"][0]})
    _check_stream(theirs, ours, lambda c: c["choices"][0]["delta"].get("content"))
    for chunks in (theirs, ours):
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_chat_stream_chunk_fields_are_a_subset_of_vllms(bases, greedy):
    theirs, ours = _streams(bases, "/v1/chat/completions", {"messages": greedy["chat-ascii"][0]})
    for mine, their in zip(ours, theirs, strict=True):
        assert_fields_subset(mine, their, "chunk")


def test_n_choices_stream_alike(bases):
    theirs, ours = _streams(bases, "/v1/completions", {"prompt": "Hello world", "n": 2,
                                                       "temperature": 0.8, "seed": 3,
                                                       "max_tokens": 3})
    for chunks in (theirs, ours):
        indices = sorted(c["choices"][0]["index"] for c in chunks[:-1])
        assert indices == [0, 0, 0, 1, 1, 1]
    assert ours[-1]["usage"]["completion_tokens"] == theirs[-1]["usage"]["completion_tokens"]


def test_logprob_tokens_of_partial_utf8_differ(clients):
    # The tiny tokenizer learned its merges from ASCII text: every other character is split
    # into byte tokens, so the echoed prompt's tokens end inside characters.
    prompt = "Größe: 東京 → 北京 🚀"
    vllm, ours = both(clients, "completions", prompt=prompt, max_tokens=1, temperature=0,
                      echo=True, logprobs=0)
    a, b = vllm.choices[0], ours.choices[0]
    assert a.text.startswith(prompt) and b.text.startswith(prompt)  # the texts agree ...
    size = len(b.logprobs.tokens) - 1  # ... the prompt's tokens do not
    assert "\ufffd" in b.logprobs.tokens[:size]
    assert b.logprobs.tokens[:size] != a.logprobs.tokens[:size], \
        f"no longer differs, remove it: {DIFFERENCES['partial_utf8_token']}"


# -- errors ---------------------------------------------------------------------------------

def _outcome(response: httpx.Response) -> tuple:
    """``(status, error type, param)`` of a response (``None`` for a 200's type and param)."""
    error = response.json().get("error", {}) if response.status_code != 200 else {}
    return response.status_code, error.get("type"), error.get("param")


@pytest.mark.parametrize("endpoint, body, difference", ERROR_CASES)
def test_bad_requests_get_the_same_answer(bases, endpoint, body, difference):
    body = {"model": MODEL, "max_tokens": 2, **body}
    if body["model"] is None:
        del body["model"]
    vllm, ours = (_outcome(r) for r in post_both(bases, f"/v1/{endpoint}", body))
    if difference is not None:
        assert ours != vllm, f"no longer differs, remove it: {DIFFERENCES[difference]}"
        return
    assert ours[:2] == vllm[:2]
    if vllm[2] is not None:  # vLLM names the parameter only for some errors
        assert ours[2] == vllm[2]


def test_bad_json_gets_400_from_both(bases):
    for name in ("vllm", "labkit"):
        response = httpx.post(bases[name] + "/v1/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == 400
        if name == "vllm":
            assert response.json()["error"]["type"] == "Bad Request", \
                DIFFERENCES["validation_error"]


def test_unknown_routes_and_methods(bases):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        theirs, ours = (httpx.request(method, bases[name] + path) for name in ("vllm", "labkit"))
        assert theirs.status_code == ours.status_code == status
        assert "detail" in theirs.json(), DIFFERENCES["route_errors"]
        assert ours.json()["error"]["code"] == status


def test_oversized_body(bases):
    body = {"model": MODEL, "prompt": "word " * (4 * 2**20 // 5 + 1), "max_tokens": 1}
    theirs, ours = post_both(bases, "/v1/completions", body)
    assert ours.status_code == 413, DIFFERENCES["body_limit"]
    assert _outcome(theirs)[:2] == (400, "BadRequestError")  # parsed: too long a prompt


# -- metrics --------------------------------------------------------------------------------

def test_labkit_metrics_exist_in_vllm_with_the_same_type_labels_and_buckets(bases):
    theirs, ours = scrape(bases["vllm"]), scrape(bases["labkit"])
    exported = [name for name in ours if name.startswith("vllm:")]
    assert len(exported) >= 10
    for name in exported:
        mine, their = ours[name], theirs.get(name)
        assert their is not None, f"vLLM has no {name}"
        assert mine.type == their.type, name
        labels = [{k for s in f.samples for k in s.labels} for f in (mine, their)]
        assert labels[0] == labels[1], name
        if mine.type == "histogram":
            edges = [sorted({float(s.labels["le"]) for s in f.samples if "le" in s.labels})
                     for f in (mine, their)]
            assert edges[0] == edges[1], name


COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
            "vllm:e2e_request_latency_seconds_count")


def counters(base: str) -> dict[str, float]:
    return sample_totals(httpx.get(base + "/metrics", timeout=10).text, COUNTERS)


def test_counters_move_alike_on_a_shared_prefix_workload(bases, clients):
    """Three prompts share a prefix of more than two blocks, new to both servers: the first
    misses, the others hit its full blocks. vLLM updates its metrics after answering, so the
    scrape waits until it has seen every request end."""
    prefix = f"Request {uuid.uuid4().hex}: " + "the scheduler batches requests " * 60
    questions = ("What is TTFT?", "What is TPOT?", "What is goodput?")
    deltas = {}
    for name, base in bases.items():
        before = counters(base)
        for question in questions:
            clients[name].completions.create(model=MODEL, prompt=prefix + question, max_tokens=4,
                                             temperature=0, extra_body={"ignore_eos": True})
        after = {}

        def all_counted(base=base, before=before, after=after) -> bool:
            after.update(counters(base))
            done = after["vllm:e2e_request_latency_seconds_count"] - before.get(
                "vllm:e2e_request_latency_seconds_count", 0)
            return done >= len(questions)

        wait_until(all_counted, 10, 0.1, what=f"{name} counting every request")
        deltas[name] = {k: after[k] - before.get(k, 0) for k in COUNTERS}
    assert deltas["labkit"] == deltas["vllm"]
    assert deltas["vllm"]["vllm:prefix_cache_hits_total"] >= 2 * 256  # two blocks, twice
    assert deltas["vllm"]["vllm:generation_tokens_total"] == 3 * 4


def test_labkit_bench_sends_what_vllm_bench_serve_sends(shared_vllm):
    """``labkit.bench`` and vLLM's own ``vllm bench serve`` send one random workload (40
    requests, 64 tokens in, 32 out, 4 requests/s, seed 0) to the same server; its own
    counters say how many prompt tokens each sent. labkit's prompts are exactly the
    workload's; vLLM's drift by the tokens that do not survive a decode and re-encode
    (:func:`labkit.simulate.prompts.ordinary_token_ids`), within 1 %. Latencies are not
    compared here: benchmarks/vllm_vs_labkit.py prints them, side by side."""
    from labkit.bench import benchmark
    from labkit.lab import detect
    from labkit.simulate import random_dataset
    from labkit.vllm_cpu import bench_serve

    _, cfg = shared_vllm
    num, input_len, output_len, rate = 40, 64, 32, 4.0
    ended = "vllm:e2e_request_latency_seconds_count"

    def prompt_tokens(requests_before: float = 0.0) -> dict[str, float]:
        """The server's counters once it has counted ``num`` more ended requests (it updates
        them after answering)."""
        now = {}

        def all_counted() -> bool:
            now.update(counters(cfg.base_url))
            return now.get(ended, 0) >= requests_before + num

        wait_until(all_counted, 30, 0.1, what="vLLM counting every request")
        return now

    before = counters(cfg.base_url)
    theirs = bench_serve(detect().vllm_cpu_python, cfg.base_url, MODEL, cfg.model, [
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num),
        "--request-rate", str(rate), "--seed", "0", "--ignore-eos"], timeout_s=300)
    between = prompt_tokens(before.get(ended, 0))
    ours = benchmark(cfg.base_url, MODEL, random_dataset(num, input_len, output_len, seed=0),
                     request_rate=rate, tokenizer=cfg.model)
    after = prompt_tokens(between[ended])
    sent = "vllm:prompt_tokens_total"
    assert theirs["completed"] == ours.completed == num
    assert theirs["total_output_tokens"] == ours.total_output_tokens == num * output_len
    # The server's own count of labkit's prompt tokens is the workload's, token for token.
    assert after[sent] - between[sent] == ours.total_input_tokens == num * input_len
    assert abs((between[sent] - before.get(sent, 0)) - num * input_len) <= num * input_len / 100
