"""One benchmark harness for every OpenAI-compatible server (:ref:`ch02-benchmarking`).

It follows ``vllm bench serve``: requests leave at gamma-distributed times (``burstiness`` 1
is Poisson) at ``request_rate`` per second, or as fast as ``max_concurrency`` allows; each is
streamed, and the arrival time of every token is recorded. TTFT, TPOT, ITL, E2EL, throughput
and goodput come out with vLLM's names (:class:`labkit.simulate.BenchmarkResult`), so a run
against vLLM on a GPU and a run against ``labkit serve`` on a laptop print the same table.
Token counts are the server's own (``usage``), not a client-side estimate: a busy server may
put several tokens in one streamed chunk, so chunks are not tokens. Times are per chunk, as
``vllm bench serve`` takes them: TTFT at the first, ITL between chunks, and TPOT spreads the
time after the first chunk over the server's count of the tokens after the first.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import numpy as np

from labkit.checks import ParameterError, positive_int
from labkit.http.client import client_pool
from labkit.http.sse import IncompleteStream, read_events
from labkit.simulate.metrics import BenchmarkResult, RequestLatencies, summarize_latencies
from labkit.simulate.prompts import TokenizerLike
from labkit.simulate.workload import BenchRequest, Workload


def request_latencies(request_id: str, prompt_tokens: int, output_tokens: int, start_s: float,
                      chunk_times_s: Sequence[float]) -> RequestLatencies:
    """One streamed request's latencies (ms) from its send time and the arrival time of each
    chunk that carried text, with the server's token counts (``usage``).

    TPOT is ``(E2EL - TTFT) / (output_tokens - 1)``: the tokens after the first, however many
    chunks brought them. With one token per chunk it equals the mean ITL.
    """
    if not chunk_times_s:
        raise ParameterError("chunk_times_s", f"chunk_times_s must hold at least one time: "
                                              f"request {request_id!r} received no token")
    positive_int("output_tokens", output_tokens)
    ttft_s, e2el_s = chunk_times_s[0] - start_s, chunk_times_s[-1] - start_s
    tpot_s = (e2el_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0
    return RequestLatencies(request_id, prompt_tokens, output_tokens, 1e3 * ttft_s,
                            1e3 * tpot_s, 1e3 * e2el_s, tuple(1e3 * np.diff(chunk_times_s)))


async def _one(http: httpx.AsyncClient, model: str, request: BenchRequest,
               index: int) -> RequestLatencies | None:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start, chunk_times, usage = time.perf_counter(), [], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return None
        try:
            async for chunk in read_events(response.aiter_lines()):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    chunk_times.append(time.perf_counter())
        except IncompleteStream:
            pass  # as in vllm bench serve, what arrived before the cut still counts
    if not chunk_times or usage is None:
        return None
    return request_latencies(f"bench-{index}", usage["prompt_tokens"],
                             usage["completion_tokens"], start, chunk_times)


def server_tokenizer(tokenizer: TokenizerLike | str | os.PathLike | None) -> TokenizerLike | None:
    """``tokenizer`` as an object, from what the server loaded (``vllm bench serve
    --tokenizer`` takes the same): a model directory is read with the teaching engine's
    :class:`~labkit.engine.tokenizer.Tokenizer`, as ``transformers`` reads it; a Hugging Face
    model name with ``transformers`` where it is installed (the GPU path); an object or None
    passes through."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if (Path(tokenizer) / "tokenizer.json").is_file():
        from labkit.engine.tokenizer import Tokenizer

        return Tokenizer(tokenizer)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ParameterError("tokenizer", f"tokenizer must be a model directory with a "
                                          f"tokenizer.json, or a model name where transformers "
                                          f"is installed, got {os.fspath(tokenizer)!r}") from None
    return AutoTokenizer.from_pretrained(os.fspath(tokenizer))


async def benchmark_async(base_url: str, model: str, workload: Workload,
                          request_rate: float | None = None, burstiness: float = 1.0,
                          max_concurrency: int | None = None,
                          slos_ms: Mapping[str, float] | None = None,
                          progress: bool = False,
                          tokenizer: TokenizerLike | str | os.PathLike | None = None,
                          api_key: str | None = None) -> BenchmarkResult:
    """Send ``workload`` to ``base_url`` and summarize what was measured.

    Each request leaves at its arrival time, or, given ``request_rate`` (and
    ``burstiness``), at the times :meth:`~labkit.simulate.Workload.at_rate` draws, as
    ``vllm bench serve --request-rate --burstiness`` sends; at most ``max_concurrency`` are
    open at once. Prompts are the workload's text view
    (:meth:`~labkit.simulate.Workload.bench_requests`): give the server's ``tokenizer`` (its
    model directory, as ``vllm bench serve --tokenizer``) and each prompt is as many tokens
    as the workload says, by the server's count; without it, one word per token. A server
    started with an API key (``VLLM_API_KEY``) is sent ``api_key``.
    """
    if max_concurrency is not None:
        positive_int("max_concurrency", max_concurrency)
    from tqdm.auto import tqdm

    if request_rate is not None:
        workload = workload.at_rate(request_rate, burstiness)
    requests = workload.bench_requests(server_tokenizer(tokenizer))
    send_at = workload.arrival_s
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")
    async with client_pool(base_url, max_concurrency or len(requests) or 1,
                           api_key=api_key) as (http, gate):
        start = time.perf_counter()

        async def send(i: int, request: BenchRequest):
            await asyncio.sleep(max(0.0, start + send_at[i] - time.perf_counter()))
            async with gate:
                result = await _one(http, model, request, i)
            bar.update(1)
            return result

        results = await asyncio.gather(*(send(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    bar.close()
    completed = [r for r in results if r is not None]
    return summarize_latencies(completed, duration, slos_ms)


def benchmark(base_url: str, model: str, workload: Workload,
              **kwargs) -> BenchmarkResult:
    """Blocking :func:`benchmark_async`; in Jupyter use ``await benchmark_async(...)``."""
    return asyncio.run(benchmark_async(base_url, model, workload, **kwargs))


async def sweep_async(base_url: str, model: str, workload: Workload,
                      request_rates: Sequence[float],
                      **kwargs) -> list[tuple[float, BenchmarkResult]]:
    """One benchmark per request rate: the throughput-latency curve of a real server."""
    return [(rate, await benchmark_async(base_url, model, workload, request_rate=rate, **kwargs))
            for rate in request_rates]
