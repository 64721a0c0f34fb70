"""A step load through a gateway whose replicas an HPA scales: 1 -> N -> 1 (chapter 5).

``labkit gateway`` runs in its own process with no backend; a
:class:`labkit.autoscale.controller.ProcessAutoscaler` in this one
(:class:`labkit.harness.steps.AutoscaledFleet` holds both) starts the first
``labkit serve`` replica (the tiny model) and then scales on the replicas' scraped
``vllm:num_requests_waiting``: an HPA with a target of ``--target`` requests waiting per
replica, a sync every ``--sync-period-s`` and a ``--scale-down-window-s`` stabilization
window (Kubernetes' defaults, 15 s and 300 s, would make this run last minutes).

The load is a step: ``--users`` clients each stream one completion after another for
``--load-s`` seconds, then stop. Printed:

* the replica timeline, one line per sync: what the HPA saw (ready and starting replicas,
  the requests running and waiting in the ready ones) and what it asked for. Of the
  ``--users`` requests open during the load, those neither running nor waiting in a
  replica are in the gateway or the clients, where no replica's metrics see them;
* each replica's events (started, ready, chosen for scale-down, drained and removed,
  stopped);
* request outcomes: complete (status 200, every event through ``data: [DONE]``, no error
  event: ``complete`` in :func:`labkit.http.client.stream_completion`) or failed; 0 failed is
  expected, since scale-up only adds backends and scale-down drains a replica before stopping
  it;
* TTFT p50 and p99 (measured by the client, through the gateway) of the requests sent
  **before** the scale-up (one replica, from the step until the HPA asks for more),
  **during** it (replicas starting) and **after** it (every new replica ready, until the
  load stops), and the requests completed per second in each of those spans: the users
  are a closed loop (each sends its next request when the last one ends), so that is the
  throughput of the whole path, clients, gateway and replicas.

Each replica's batch is capped (``--max-num-seqs``, as KV-cache memory caps it on a GPU), so
requests wait at the replica and a new replica adds capacity. Here the replicas also share
the machine's cores with each other, the gateway and the clients: on 2 cores, expect much
less than N times the throughput from N replicas (a GPU replica brings its own GPU). Once
the replicas stop being the bottleneck, the requests queue in the gateway instead, where
``vllm:num_requests_waiting`` does not see them: with a short window
(``--scale-down-window-s 5``) the HPA then scales down in the middle of the load and back
up a few seconds later, the flapping Kubernetes' 300 s default window exists to damp.

The exit status is 0 when no request failed and the fleet went from 1 to more than 1
replica and back to 1, 1 otherwise.

    python benchmarks/autoscale_step.py [--users 64] [--load-s 20] [--max-replicas 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import numpy as np

from labkit.autoscale.hpa import HPAScalingPolicy, HPAScalingRules, HorizontalPodAutoscaler
from labkit.autoscale.observation import WAITING
from labkit.engine import write_tiny_model
from labkit.harness.steps import AutoscaledFleet
from labkit.http.client import StreamResult, client_pool, stream_completion
from labkit.http.metrics import sample_totals
from labkit.launch import ServeConfig
from labkit.process import exit_on_sigterm

MODEL = "tiny"


@dataclass(frozen=True)
class Sent:
    """One request of the step load: when it was sent and ended (``time.monotonic``, the
    autoscaler's clock) and how it ended."""

    sent: float
    done: float
    result: StreamResult

    @property
    def ok(self) -> bool:
        return self.result.outcome == "complete"


async def step_load(url: str, users: int, load_s: float, max_tokens: int) -> list[Sent]:
    """``users`` closed-loop users, each streaming one completion after another for
    ``load_s`` seconds."""
    results: list[Sent] = []
    end = time.monotonic() + load_s
    async with client_pool(url, users, timeout_s=120) as (client, _):
        async def user(u: int) -> None:
            i = 0
            while time.monotonic() < end:
                sent = time.monotonic()
                result = await stream_completion(client, MODEL, f"user {u} request {i}: hello",
                                                 max_tokens)
                results.append(Sent(sent, time.monotonic(), result))
                i += 1
        await asyncio.gather(*(user(u) for u in range(users)))
    return results


def percentiles_ms(results: list[Sent]) -> str:
    ttfts = [r.result.ttft_ms for r in results if r.ok]
    if not ttfts:
        return "no requests"
    return (f"{len(ttfts):5d} requests  TTFT p50 {np.percentile(ttfts, 50):7.1f} ms  "
            f"p99 {np.percentile(ttfts, 99):7.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--load-s", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="each replica's batch cap (on a GPU, KV-cache memory sets it)")
    parser.add_argument("--target", type=float, default=4.0,
                        help="requests waiting per replica the HPA aims at")
    parser.add_argument("--sync-period-s", type=float, default=1.0)
    parser.add_argument("--scale-down-window-s", type=int, default=15)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    policy = HorizontalPodAutoscaler(
        WAITING, args.target, min_replicas=1, max_replicas=args.max_replicas,
        scale_down=HPAScalingRules(args.scale_down_window_s,
                                   (HPAScalingPolicy("Percent", 100, 15),)),
        sync_period_s=args.sync_period_s)
    # SIGTERM or Ctrl-C ends the run with every replica drained and stopped.
    with exit_on_sigterm(), tempfile.TemporaryDirectory() as tmp:
        serve = ServeConfig(model=str(write_tiny_model(os.path.join(tmp, "tiny"))),
                            served_model_name=MODEL, max_model_len=512,
                            max_num_seqs=args.max_num_seqs)
        # The gateway routes least_requests, which never sheds load.
        with AutoscaledFleet(policy, serve, max_replicas=args.max_replicas,
                             drain_timeout_s=30) as fleet:
            scaler, url = fleet.scaler, fleet.base_url
            step_at = time.monotonic()
            results = asyncio.run(step_load(url, args.users, args.load_s, args.max_tokens))
            load_end = time.monotonic()
            deadline = load_end + args.scale_down_window_s + 60
            while scaler.ready_count != 1 or any(
                    r.phase not in ("ready", "stopped") for r in scaler.replicas()):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            back_to_one = [r.phase for r in scaler.replicas()
                           if r.phase != "stopped"] == ["ready"]
            counters = sample_totals(httpx.get(url + "/metrics", trust_env=False).text)

    print(f"\nreplica timeline (s since the step; HPA: target {args.target:g} waiting per "
          f"replica, sync {args.sync_period_s:g} s, scale-down window "
          f"{args.scale_down_window_s} s)")
    print("     t   ready  starting  running  waiting  asked  desired")
    for h in scaler.history:
        print(f"{h.time_s - step_at:6.1f}  {h.ready:6d}  {h.starting:8d}  {h.running:7.0f}  "
              f"{h.waiting:7.0f}  {h.decided:5d}  {h.desired:7d}")
    print(f"(the users stopped sending at {args.load_s:g} s, the last request ended at "
          f"{load_end - step_at:.1f} s; until then {args.users} requests were open, those "
          f"neither running nor waiting in a replica being in the gateway or the clients)")
    print("\nreplica events")
    for e in scaler.events:
        detail = e.detail.splitlines()[0] if e.detail else ""
        print(f"{e.time_s - step_at:6.1f}  {e.replica:10s} {e.kind:10s} {detail}")

    scale_up = next((h.time_s for h in scaler.history if h.desired > 1), None)
    top = max(h.desired for h in scaler.history)
    ready_times = [e.time_s for e in scaler.events if e.kind == "ready"]  # in order
    all_ready = ready_times[top - 1] if len(ready_times) >= top else None
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results)} streamed requests from {args.users} users over {args.load_s:g} s"
          f" ({args.max_tokens} tokens each): {len(results) - len(failed)} complete, "
          f"{len(failed)} failed (expected 0)")
    for r in failed[:5]:
        print(f"  failed ({r.result.outcome}): {r.result.error}")
    print("the gateway counted: " + ", ".join(
        f"{counters.get(f'labkit_gateway_{name}_total', 0):g} {name.replace('_', ' ')}"
        for name in ("retries", "streams_cut", "ejections", "readmissions")))
    if scale_up is not None:
        ready_at = "never" if all_ready is None else f"{all_ready - step_at:.1f} s"
        print(f"scale-up asked at {scale_up - step_at:.1f} s, {top} replicas ready at "
              f"{ready_at}")
        end_of_during = all_ready if all_ready is not None else step_at + args.load_s
        bounds = [step_at, scale_up, end_of_during, step_at + args.load_s]  # while sending
        names = ["before the scale-up", "during the scale-up", "after the scale-up"]
        for i, name in enumerate(names):
            start, end = bounds[i], bounds[i + 1]
            sent = [r for r in results if start <= r.sent < end]
            done = sum(r.ok and start <= r.done < end for r in results)
            rate = f"{done / (end - start):5.1f}" if end > start else "    -"
            print(f"  {name:20s} {percentiles_ms(sent)}  completed {rate} requests/s")
    went_up = max(h.ready for h in scaler.history) > 1
    print(f"went 1 -> {max(h.ready for h in scaler.history)} -> "
          f"{'1' if back_to_one else 'not back to 1'}")
    return 0 if not failed and went_up and back_to_one else 1


if __name__ == "__main__":
    sys.exit(main())
