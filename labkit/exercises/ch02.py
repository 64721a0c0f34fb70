"""Checks for the exercises of the chapter 2 labs (engines, the OpenAI API, benchmarks)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from labkit.checks import in_range
from labkit.grading import Feedback, check_number
from labkit.hardware import get_model, kv_cache_bytes_per_token, kv_dtype_bytes
from labkit.http.metrics import sample_totals
from labkit.launch import trtllm_kv_fraction
from labkit.simulate.metrics import BenchmarkResult, RequestLatencies
from labkit.units import GiB


def check_stop_params(params) -> Feedback:
    """Lab 02a: SamplingParams that stop at the first period, greedy, at most 20 tokens."""
    if params is None:
        return Feedback(False, "Not answered yet: build the SamplingParams.")
    problems = []
    if "." not in list(getattr(params, "stop", None) or []):
        problems.append('stop should contain "."')
    if getattr(params, "max_tokens", None) != 20:
        problems.append("max_tokens should be 20")
    if getattr(params, "temperature", None) != 0:
        problems.append("temperature 0 makes decoding greedy")
    if problems:
        return Feedback(False, "Not quite: " + "; ".join(problems) + ".")
    return Feedback(True, "Correct: greedy, stops at the first period or after 20 tokens.")


def check_chat_body(body: Mapping | None, model: str) -> Feedback:
    """Lab 02b: a streaming, greedy chat-completion request body for ``model``."""
    if body is None:
        return Feedback(False, "Not answered yet: write the request body.")
    problems = []
    if body.get("model") != model:
        problems.append(f"model should be {model!r}")
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in messages)):
        problems.append("messages should be a list of {'role': ..., 'content': ...}")
    if body.get("stream") is not True:
        problems.append("stream should be True")
    if body.get("temperature") != 0:
        problems.append("temperature should be 0")
    if problems:
        return Feedback(False, "Not quite: " + "; ".join(problems) + ".")
    return Feedback(True, "Correct: the server will stream a greedy reply.")


def check_prefix_hit_rate(answer: object, metrics_text: str) -> Feedback:
    """Lab 02b: the prefix-cache hit rate from a ``/metrics`` scrape (hits / queries)."""
    totals = sample_totals(metrics_text, ["vllm:prefix_cache_hits_total",
                                          "vllm:prefix_cache_queries_total"])
    hits = totals.get("vllm:prefix_cache_hits_total", 0.0)
    queries = totals.get("vllm:prefix_cache_queries_total", 0.0)
    if not queries:
        return Feedback(False, "The scrape has no prefix-cache queries yet: send requests first.")
    return check_number(answer, hits / queries, what="prefix cache hit rate", rel_tol=0.01,
                        mistakes={"divided queries by hits": queries / hits if hits else -1,
                                  "gave a percentage, not a fraction": 100 * hits / queries})


def check_tpot_ms(answer: object, start_s: float, token_times_s: Sequence[float]) -> Feedback:
    """Lab 02c: TPOT of one request from its send time and token arrival times."""
    m = RequestLatencies.from_times("exercise", 0, start_s, token_times_s)
    n = len(token_times_s)
    mistakes = {"included the first token (TTFT) in the average": m.e2el_ms / n,
                "divided by the number of tokens instead of tokens - 1":
                    (m.e2el_ms - m.ttft_ms) / n}
    return check_number(answer, m.tpot_ms, what="TPOT", unit="ms", rel_tol=0.01,
                        mistakes=mistakes)


def check_goodput(answer: object, ttft_ms: Sequence[float], tpot_ms: Sequence[float],
                  duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> Feedback:
    """Lab 02c: requests per second that met both SLOs."""
    good = sum(t <= slo_ttft_ms and p <= slo_tpot_ms
               for t, p in zip(ttft_ms, tpot_ms, strict=True))
    only_ttft = sum(t <= slo_ttft_ms for t in ttft_ms)
    return check_number(answer, good / duration_s, what="goodput", unit="req/s", rel_tol=0.01,
                        mistakes={"checked the TTFT SLO only": only_ttft / duration_s,
                                  "counted all requests (that is throughput)":
                                      len(ttft_ms) / duration_s,
                                  "counted good requests, not per second": float(good)})


def check_kv_bytes_per_token(answer: object, model, kv_dtype: str = "bf16") -> Feedback:
    """Lab 02b: KV-cache bytes one token takes in ``model`` (a ``ModelSpec`` or preset name),
    all layers, K and V, in ``kv_dtype``: what vLLM divides its KV memory by."""
    spec = get_model(model)
    per_value = kv_dtype_bytes(kv_dtype)
    expected = kv_cache_bytes_per_token(spec, kv_dtype)
    per_head = spec.num_layers * spec.head_dim * per_value
    mistakes = {"used the attention heads, not the KV heads":
                    2 * per_head * spec.num_attention_heads,
                "counted K or V, not both": expected / 2,
                "left out the layers (this is one layer)": expected / spec.num_layers,
                "used 4 bytes per value (fp32)": expected * 4 / per_value,
                "counted elements, not bytes": expected / per_value}
    merged: dict[float, list[str]] = {}  # a small model can make two mistakes agree
    for description, value in mistakes.items():
        merged.setdefault(value, []).append(description)
    return check_number(answer, expected, what="KV bytes per token", unit="bytes", rel_tol=0,
                        mistakes={", or ".join(d): v for v, d in merged.items() if v != expected})


def check_speedup(answer: object, fast: BenchmarkResult, slow: BenchmarkResult,
                  what: str = "speedup") -> Feedback:
    """Lab 02c: how many times more output tokens per second ``fast`` served than ``slow``
    (two :class:`~labkit.simulate.BenchmarkResult` of the same requests)."""
    expected = fast.output_throughput / slow.output_throughput
    return check_number(answer, expected, what=what, unit="x", rel_tol=0.01,
                        mistakes={"divided the other way round": 1 / expected,
                                  "gave the gain in percent": 100 * (expected - 1)})


#: Exercise 1 of lab ``gpu/sglang``: 24-hour times a pattern must accept, and strings it must
#: refuse (an hour past 23, a minute past 59, one digit where two belong, anything around it).
TIMES_VALID = ("00:00", "09:30", "12:05", "19:45", "23:59")
TIMES_INVALID = ("24:00", "9:30", "12:60", "23:5", "12:30pm", " 12:30", "1230", "29:00")


def check_time_regex(pattern: object) -> Feedback:
    """Lab ``gpu/sglang``, exercise 1: a regular expression matching exactly a 24-hour time
    ``HH:MM``, as SGLang's ``regex`` sampling parameter takes one (the whole output must match
    it, so it is tested with ``fullmatch``)."""
    if pattern is None:
        return Feedback(False, "Not answered yet: write the pattern as a string.")
    if not isinstance(pattern, str):
        return Feedback(False, f"the pattern must be a string, got {type(pattern).__name__}.")
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        return Feedback(False, f"the pattern does not compile: {err}.")
    refused = [t for t in TIMES_VALID if not compiled.fullmatch(t)]
    accepted = [t for t in TIMES_INVALID if compiled.fullmatch(t)]
    if refused or accepted:
        problems = ([f"refuses {', '.join(map(repr, refused))}"] if refused else []) + (
            [f"accepts {', '.join(map(repr, accepted))}"] if accepted else [])
        return Feedback(False, f"Not quite: the pattern {' and '.join(problems)}.")
    return Feedback(True, f"Correct: {pattern!r} matches every 24-hour time and nothing else "
                          f"tested.")


def check_trtllm_kv_fraction(answer: object, gpu_memory_utilization: float = 0.9,
                             gpu_gib: float = 80.0, weights_gib: float = 15.0) -> Feedback:
    """Lab ``gpu/tensorrt_llm``, exercise 1: TensorRT-LLM's
    ``--kv_cache_free_gpu_memory_fraction`` that gives the KV cache what vLLM's
    ``--gpu-memory-utilization`` gives it on a GPU of ``gpu_gib`` GiB with ``weights_gib`` GiB
    of weights, activations left out (:func:`labkit.launch.trtllm_kv_fraction`)."""
    in_range("gpu_gib", gpu_gib, 0, low_open=True)
    u, total, weights = gpu_memory_utilization, gpu_gib * GiB, weights_gib * GiB
    expected = trtllm_kv_fraction(u, total, weights)
    mistakes = {"copied vLLM's fraction: TensorRT-LLM's is a fraction of the memory the weights "
                "leave, not of the whole GPU": u,
                "divided by the whole GPU instead of what the weights leave":
                    (u * total - weights) / total}
    return check_number(answer, expected, what="kv_cache_free_gpu_memory_fraction",
                        rel_tol=0.005, mistakes=mistakes)
