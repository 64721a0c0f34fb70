"""A load test of labkit.gateway with a backend killed mid-run and restarted (chapter 5).

Three ``labkit serve`` processes (the tiny model, ``labkit tiny-model``) behind ``labkit
gateway``, also its own process (:mod:`labkit.harness.fleet`). A client keeps
``--concurrency`` streamed completions open until ``--requests`` have been sent. Once a third
of them have finished, one backend is killed with SIGKILL while it streams (a crash: no
graceful shutdown); once two thirds have finished, it is started again on the same port.
Each request ends one of five ways, as :func:`labkit.http.client.stream_completion`
classifies it:

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
import os
import random
import sys
import tempfile
import time

import numpy as np

from labkit.engine import write_tiny_model
from labkit.gateway.routing import STRATEGIES
from labkit.harness.counters import gateway_metrics
from labkit.harness.fleet import BackendFleet, start_gateway
from labkit.http.client import StreamResult, client_pool, count_outcomes, stream_completion
from labkit.http.metrics import sample_totals
from labkit.process import wait_until

MODEL = "tiny"
WORDS = "the quick brown fox jumps over a lazy dog while gateways route streams".split()
VICTIM = 2


async def running_requests(client, backend_url: str) -> float:
    """``vllm:num_requests_running`` of one backend, read from its own ``/metrics``."""
    text = (await client.get(backend_url + "/metrics")).text
    totals = sample_totals(text, ["vllm:num_requests_running"])
    return totals.get("vllm:num_requests_running", 0.0)


async def run_load(gateway_url: str, fleet: BackendFleet, requests: int, concurrency: int,
                   seed: int) -> tuple[list[StreamResult], float]:
    """The load, the kill and the restart; returns the results and the run's duration in
    seconds."""
    rng = random.Random(seed)
    results: list[StreamResult] = []
    next_index = 0

    async def worker(client) -> None:
        nonlocal next_index
        while next_index < requests:
            i, next_index = next_index, next_index + 1
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            results.append(await stream_completion(client, MODEL, f"{i}: {prompt}",
                                                   rng.randint(16, 96)))

    async def chaos(client) -> None:
        while len(results) < requests // 3:
            await asyncio.sleep(0.01)
        # Kill it while it streams: its own metrics count requests running, and a request
        # is running once a step has given it its first token, the event the gateway relays.
        while await running_requests(client, fleet.urls[VICTIM]) < 2:
            await asyncio.sleep(0.005)
        fleet.kill(VICTIM)
        print(f"killed {fleet.urls[VICTIM]} after {len(results)} requests")
        while len(results) < 2 * requests // 3:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(fleet.restart, VICTIM)
        print(f"restarted {fleet.urls[VICTIM]} after {len(results)} requests")

    started = time.perf_counter()
    async with client_pool(gateway_url, concurrency, timeout_s=120) as (client, _):
        await asyncio.gather(chaos(client), *(worker(client) for _ in range(concurrency)))
    return results, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--strategy", choices=STRATEGIES, default="least_requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(os.path.join(tmp, "tiny")))
        with BackendFleet(model, 3, served_model_name=MODEL, max_model_len=512) as fleet:
            gateway = start_gateway(fleet.urls, args.strategy, seed=args.seed)
            try:
                results, duration_s = asyncio.run(run_load(
                    gateway.base_url, fleet, args.requests, args.concurrency, args.seed))
                victim = fleet.urls[VICTIM]
                readmissions = "labkit_gateway_readmissions_total"
                try:  # re-admission takes readmit_after good probes
                    wait_until(lambda: gateway_metrics(gateway.base_url).get(
                        readmissions, {}).get(victim, 0) >= 1, timeout_s=30)
                except TimeoutError:
                    pass  # reported below as not re-admitted
                metrics = gateway_metrics(gateway.base_url)
            finally:
                gateway.stop()

    outcomes = count_outcomes(results)
    ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
    ejected = metrics.get("labkit_gateway_ejections_total", {}).get(victim, 0)
    readmitted = metrics.get(readmissions, {}).get(victim, 0)
    retries = sum(metrics.get("labkit_gateway_retries_total", {}).values())
    cut_metric = metrics.get("labkit_gateway_streams_cut_total", {}).get(victim, 0)
    print(f"{len(results)} streamed requests, {args.concurrency} at a time, strategy "
          f"{args.strategy}, in {duration_s:.1f} s; TTFT p50 {np.percentile(ttfts, 50):.1f}"
          f" ms, p90 {np.percentile(ttfts, 90):.1f} ms")
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
        if r.outcome in ("lost", "broken"):
            print(f"    {r.outcome}: {r.error}")
    example = next((r.error for r in results if r.outcome == "cut"), None)
    if example:
        print(f"  a cut stream's error: {example}")
    ok = not outcomes["lost"] and not outcomes["broken"] and ejected >= 1 and readmitted >= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
