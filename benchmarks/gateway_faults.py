"""Three faults under streamed load through labkit's gateway, counted as a client sees them
(chapter 5, :ref:`ch05-timeouts`).

Three ``labkit serve`` backends (the tiny model) behind a ``labkit gateway`` with its default
timeouts; ``--requests`` greedy streams (16 to 64 tokens), ``--concurrency`` at a time, per
run. One run per fault and strategy (``endpoint_picker``, the default, and ``round_robin``):

* ``kill``: backend 0 gets SIGKILL once it is streaming (a crash), and is restarted after;
* ``stop``: backend 0 gets SIGSTOP once it is streaming and SIGCONT ``--stop-s`` seconds later
  (a hang: alive, accepting connections, answering nothing; by default longer than the
  clients wait, as a wedged GPU stays wedged);
* ``nan``: backend 0 sits behind a proxy whose ``/metrics`` reports
  ``vllm:num_requests_waiting NaN`` for the whole run.

Printed per run: how every stream ended (``complete``, ``cut`` with an error event,
``broken`` without one, ``lost`` before streaming, ``shed`` with 429, ``hung`` when still open
after the client's ``--deadline-s``), the gateway's timeouts, retries and ejections, and, after
``stop`` and ``kill``, how many of ``--after`` further requests went to backend 0 once it was
back. The exit status is 0 when no run left a request hung or lost and the NaN runs had no
error at all, 1 otherwise. On 2 cores the whole script takes a few minutes.

    python benchmarks/gateway_faults.py [--requests 320] [--concurrency 16] [--stop-s 75]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time

from labkit.engine import write_tiny_model
from labkit.harness.asgi import serve_in_thread
from labkit.harness.counters import gateway_metrics, gateway_workers
from labkit.harness.faults import FaultRun, lying_metrics_app, run_with_fault
from labkit.harness.fleet import BackendFleet, start_gateway
from labkit.harness.load import run_requests, varied_requests
from labkit.process import wait_until

VICTIM = 0  # first in the gateway's list: where a NaN once broke the max-score picker
STRATEGIES = ("endpoint_picker", "round_robin")


def counted(base_url: str, name: str, url: str) -> float:
    """The gateway's counter ``name`` for backend ``url``, summed over its other labels."""
    return gateway_metrics(base_url).get(name, {}).get(url, 0.0)


async def one_run(fleet: BackendFleet, fault: str, strategy: str, args) -> tuple[dict, str]:
    """One fault under load; returns the outcome counts and a line of what the gateway did."""
    requests = varied_requests(args.requests, seed=7, max_tokens=(16, 64))
    with contextlib.ExitStack() as stack:
        urls = list(fleet.urls)
        if fault == "nan":
            urls[VICTIM] = stack.enter_context(serve_in_thread(lying_metrics_app(urls[VICTIM])))
        gateway = start_gateway(urls, strategy, seed=0)
        stack.callback(gateway.stop)
        base, victim = gateway.base_url, urls[VICTIM]
        if fault == "nan":
            results = await run_requests(base, fleet.model, requests,
                                         concurrency=args.concurrency, timeout_s=None,
                                         deadline_s=args.deadline_s)
            run = FaultRun("nan", results, 0, 0.0)
        else:
            run = await run_with_fault(base, fleet, VICTIM, requests, fault=fault,
                                       concurrency=args.concurrency, stop_s=args.stop_s,
                                       deadline_s=args.deadline_s)
        did = (f"timeouts {counted(base, 'labkit_gateway_timeouts_total', victim):g}, "
               f"retries {counted(base, 'labkit_gateway_retries_total', victim):g}, "
               f"ejections {counted(base, 'labkit_gateway_ejections_total', victim):g}")
        if fault in ("kill", "stop"):
            if fault == "kill":
                fleet.restart(VICTIM)
            wait_until(lambda: gateway_workers(base)[victim]["is_healthy"], 60,
                       what="backend 0 re-admitted")
            before = counted(base, "labkit_gateway_requests_total", victim)
            await run_requests(base, fleet.model, varied_requests(args.after, seed=8),
                               concurrency=2, timeout_s=None, deadline_s=args.deadline_s)
            back = counted(base, "labkit_gateway_requests_total", victim) - before
            did += f"; then {back:g} of {args.after} requests went to backend 0"
    return run.outcomes, did


async def main_async(args) -> int:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(os.path.join(tmp, "tiny")))
        with BackendFleet(model, 3, max_num_seqs=8) as fleet:
            for fault in args.faults:
                for strategy in STRATEGIES:
                    started = time.monotonic()
                    outcomes, did = await one_run(fleet, fault, strategy, args)
                    print(f"{fault:5s} {strategy:16s} {outcomes}  ({did}; "
                          f"{time.monotonic() - started:.0f} s)", flush=True)
                    bad = outcomes["hung"] + outcomes["lost"]
                    if fault == "nan":
                        bad = sum(outcomes.values()) - outcomes["complete"]
                    ok = ok and bad == 0
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stop-s", type=float, default=75.0,
                        help="how long the stopped backend stays stopped")
    parser.add_argument("--deadline-s", type=float, default=60.0,
                        help="how long a client waits before it counts its request hung")
    parser.add_argument("--after", type=int, default=12,
                        help="requests sent once the failed backend is back")
    parser.add_argument("--faults", nargs="+", default=["kill", "stop", "nan"],
                        choices=["kill", "stop", "nan"])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; outcomes per run "
          f"of {args.requests} streams at {args.concurrency} concurrent", flush=True)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
