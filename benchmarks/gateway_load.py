"""A load test of labkit.gateway with a backend killed mid-run and restarted (chapter 5).

Three ``labkit serve`` processes (the tiny model, ``labkit tiny-model``) behind ``labkit
gateway``, also its own process. A client keeps ``--concurrency`` streamed completions open
until ``--requests`` have been sent. Once a third of them have finished, one backend is killed
with SIGKILL while it streams (a crash: no graceful shutdown); once two thirds have finished,
it is started again on the same port. Each request ends one of four ways:

* **complete**: status 200, the stream ends with ``data: [DONE]`` and no error event;
* **cut with a clear error**: its backend died mid-stream; the stream ends with an error
  event (``data: {"error": ...}``) and then ``data: [DONE]``;
* **lost before streaming**: anything else that never streamed (a 5xx, a connection
  error). The gateway retries on another backend while nothing has reached the client, so
  this must be 0;
* **broken**: a stream that ends without ``[DONE]``; must be 0 as well;
* **shed**: a 429 with ``Retry-After``, the endpoint picker's saturation detector refusing
  work on purpose. The default strategy here, ``least_requests``, never sheds. With
  ``--strategy endpoint_picker`` on the 2-core machine this was written on, a few requests
  in 600 were shed: with five busy processes on two cores, a backend's ``/metrics`` answer
  sometimes took longer than the detector's 200 ms staleness bound, and once both surviving
  backends looked stale, every candidate counted as saturated.

From the gateway's own ``/metrics``: retries, cut streams, the killed backend's ejection and
its re-admission after it came back. The exit status is 0 when nothing was lost or broken and
both the ejection and the re-admission were seen, 1 otherwise.

    python benchmarks/gateway_load.py [--requests 600] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from labkit.engine import write_tiny_model
from labkit.gateway.routing import STRATEGIES
from labkit.launch import ServeConfig, ServerProcess, command_for, free_port

MODEL = "tiny"
WORDS = "the quick brown fox jumps over a lazy dog while gateways route streams".split()


def gateway_metrics(base_url: str) -> dict[tuple[str, str], float]:
    """The gateway's counters as ``{(sample name, backend label): value}``."""
    text = httpx.get(base_url + "/metrics", trust_env=False).text
    return {(s.name, s.labels.get("backend", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def running_requests(client: httpx.AsyncClient, backend_url: str) -> float:
    """``vllm:num_requests_running`` of one backend, read from its own ``/metrics``."""
    text = (await client.get(backend_url + "/metrics")).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "vllm:num_requests_running")


async def one_request(client: httpx.AsyncClient, i: int, rng: random.Random) -> dict:
    """Send one streamed completion; returns how it ended and its TTFT (seconds)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body = {"model": MODEL, "prompt": f"{i}: {prompt}", "max_tokens": rng.randint(16, 96),
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    events, ttft = [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome = "shed" if response.status_code == 429 else "lost"
                return {"outcome": outcome, "why": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    ttft = ttft or time.perf_counter() - start
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as err:
        outcome = "broken" if events else "lost"
        return {"outcome": outcome, "why": f"{type(err).__name__}: {err}"}
    if not events:
        return {"outcome": "lost", "why": "an empty stream"}
    if events[-1] != "[DONE]":
        return {"outcome": "broken", "why": "no [DONE] at the end"}
    if any("error" in e for e in events[:-1]):
        clear = "error" in events[-2] and "message" in events[-2]["error"]
        return {"outcome": "cut" if clear else "broken", "ttft_s": ttft,
                "why": events[-2]["error"]["message"] if clear else "an error event mid-stream"}
    return {"outcome": "complete", "ttft_s": ttft}


async def run_load(gateway_url: str, victim: ServerProcess, victim_cfg: ServeConfig,
                   requests: int, concurrency: int,
                   seed: int) -> tuple[list[dict], float, ServerProcess]:
    """The load, the kill and the restart; returns the results, the run's duration in
    seconds and the restarted backend's process."""
    rng = random.Random(seed)
    results: list[dict] = []
    next_index = 0
    state = {"victim": victim}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < requests:
            i, next_index = next_index, next_index + 1
            results.append(await one_request(client, i, rng))

    async def chaos(client: httpx.AsyncClient) -> None:
        while len(results) < requests // 3:
            await asyncio.sleep(0.01)
        # Kill it while it streams: its own metrics count requests running, and a request
        # is running once a step has given it its first token, the event the gateway relays.
        while await running_requests(client, victim_cfg.base_url) < 2:
            await asyncio.sleep(0.005)
        process = state["victim"].process
        os.killpg(os.getpgid(process.pid), signal.SIGKILL)
        await asyncio.to_thread(process.wait)
        print(f"killed {victim_cfg.base_url} after {len(results)} requests")
        while len(results) < 2 * requests // 3:
            await asyncio.sleep(0.01)
        state["victim"] = ServerProcess(command_for("labkit", victim_cfg), victim_cfg.base_url)
        await asyncio.to_thread(state["victim"].start)
        print(f"restarted {victim_cfg.base_url} after {len(results)} requests")

    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120, limits=limits,
                                 trust_env=False) as client:
        await asyncio.gather(chaos(client), *(worker(client) for _ in range(concurrency)))
    return results, time.perf_counter() - started, state["victim"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--strategy", choices=STRATEGIES, default="least_requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = str(write_tiny_model(os.path.join(tmp, "tiny")))
        cfgs = [ServeConfig(model=model, served_model_name=MODEL, port=free_port(),
                            max_model_len=512) for _ in range(3)]
        backends = [stack.enter_context(ServerProcess(command_for("labkit", c), c.base_url))
                    for c in cfgs]
        port = free_port()
        command = [sys.executable, "-m", "labkit.cli", "gateway", "--strategy", args.strategy,
                   "--port", str(port), "--seed", str(args.seed)]
        for c in cfgs:
            command += ["--backend", c.base_url]
        gateway = stack.enter_context(ServerProcess(command, f"http://127.0.0.1:{port}",
                                                    startup_timeout_s=60))
        results, duration_s, restarted = asyncio.run(run_load(
            gateway.base_url, backends[2], cfgs[2], args.requests, args.concurrency, args.seed))
        stack.callback(restarted.stop)
        victim = cfgs[2].base_url
        deadline = time.monotonic() + 30  # re-admission takes readmit_after good probes
        while (time.monotonic() < deadline and gateway_metrics(gateway.base_url).get(
                ("labkit_gateway_readmissions_total", victim), 0) < 1):
            time.sleep(0.2)
        metrics = gateway_metrics(gateway.base_url)

    outcomes = Counter(r["outcome"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    ejected = metrics.get(("labkit_gateway_ejections_total", victim), 0)
    readmitted = metrics.get(("labkit_gateway_readmissions_total", victim), 0)
    retries = sum(v for (name, _), v in metrics.items() if name == "labkit_gateway_retries_total")
    cut_metric = metrics.get(("labkit_gateway_streams_cut_total", victim), 0)
    print(f"{len(results)} streamed requests, {args.concurrency} at a time, strategy "
          f"{args.strategy}, in {duration_s:.1f} s; TTFT p50 {np.percentile(ttfts, 50) * 1e3:.1f}"
          f" ms, p90 {np.percentile(ttfts, 90) * 1e3:.1f} ms")
    print(f"  complete                         {outcomes['complete']}")
    print(f"  cut with a clear error event     {outcomes['cut']} (gateway counted "
          f"{cut_metric:g} on the killed backend)")
    print(f"  lost before streaming (must be 0) {outcomes['lost']}")
    print(f"  broken streams (must be 0)       {outcomes['broken']}")
    print(f"  shed with 429 + Retry-After      {outcomes['shed']}")
    print(f"  retried on another backend       {retries:g}")
    print(f"  killed backend ejected           {ejected:g} time(s)")
    print(f"  killed backend re-admitted       {readmitted:g} time(s)")
    for r in results:
        if r["outcome"] in ("lost", "broken"):
            print(f"    {r['outcome']}: {r['why']}")
    example = next((r["why"] for r in results if r["outcome"] == "cut"), None)
    if example:
        print(f"  a cut stream's error: {example}")
    ok = not outcomes["lost"] and not outcomes["broken"] and ejected >= 1 and readmitted >= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
