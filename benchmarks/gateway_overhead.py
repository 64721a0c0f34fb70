"""What a gateway adds to the time to first token: labkit.gateway and vllm-router (chapter 5).

One ``labkit serve`` backend (the tiny model), and in front of it, each in its own process:
``labkit gateway`` with the round-robin strategy and with the default endpoint picker, and
the vLLM project's ``vllm-router`` (round robin;
:func:`labkit.harness.vllm_router.start_router`). A few hundred streamed requests go one at a
time to each target in turn (direct, then each gateway, then direct again ...), so that drifts
in the machine's load touch every target alike. TTFT is measured at the client, from sending
the request to the first event that carries a token. Printed: p50 and p90 TTFT per target, the
gateway's added TTFT (its p50 less the direct p50; the goal for labkit.gateway is under 2 ms on
loopback) and the ratio to the direct TTFT. Nothing is asserted: the numbers move with
whatever else runs.

    python benchmarks/gateway_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile

import httpx
import numpy as np

from labkit.engine import write_tiny_model
from labkit.harness.fleet import gateway_command
from labkit.harness.vllm_router import start_router
from labkit.http.client import stream_completion
from labkit.launch import ServeConfig, command_for
from labkit.process import ServerProcess, free_port

MODEL = "tiny"


def gateway_process(backend: str, strategy: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(gateway_command([backend], strategy, port), f"http://127.0.0.1:{port}",
                         startup_timeout_s=60)


async def ttft_ms(targets: dict[str, str], requests: int) -> dict[str, list[float]]:
    """TTFT (ms) of ``requests`` streamed completions per target, sent one at a time and
    round-robin over the targets after 10 warm-up requests each (connections, code paths);
    measured by :func:`labkit.http.client.stream_completion`, to the first event that carries
    a choice (its text may be empty: a token that ends inside a multi-byte character is held
    back)."""
    times: dict[str, list[float]] = {name: [] for name in targets}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=60, trust_env=False))
            for name, url in targets.items()}

        async def one(name: str, prompt: str) -> float:
            result = await stream_completion(clients[name], MODEL, prompt, 4)
            if result.ttft_ms is None:
                raise RuntimeError(f"{targets[name]} streamed no token: {result.error}")
            return result.ttft_ms

        for name in targets:
            for i in range(10):
                await one(name, f"warm up {i}")
        for i in range(requests):
            for name in targets:
                times[name].append(await one(name, f"request number {i}"))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300,
                        help="streamed requests per target (default 300)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = write_tiny_model(os.path.join(tmp, "tiny"))
        cfg = ServeConfig(model=str(model), served_model_name=MODEL, port=free_port(),
                          max_model_len=256)
        stack.enter_context(ServerProcess(command_for("labkit", cfg), cfg.base_url))
        targets = {"direct": cfg.base_url}
        for strategy in ("round_robin", "endpoint_picker"):
            gateway = stack.enter_context(gateway_process(cfg.base_url, strategy))
            targets[f"labkit.gateway ({strategy})"] = gateway.base_url
        router = start_router([cfg.base_url], "round_robin")
        stack.callback(router.stop)
        targets["vllm-router (round_robin)"] = router.base_url
        times = asyncio.run(ttft_ms(targets, args.requests))
    direct_p50 = np.percentile(times["direct"], 50)
    print(f"{args.requests} streamed requests per target, one at a time, 4 tokens each")
    print(f"{'target':34s} {'p50 ms':>8s} {'p90 ms':>8s} {'added p50 ms':>13s} "
          f"{'x direct':>9s}")
    for name, samples in times.items():
        p50, p90 = np.percentile(samples, 50), np.percentile(samples, 90)
        print(f"{name:34s} {p50:8.2f} {p90:8.2f} {p50 - direct_p50:13.2f} "
              f"{p50 / direct_p50:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
