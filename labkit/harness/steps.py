"""A real fleet scaled under a step of load (:ref:`ch05-hpa-kpa-keda`, lab 05b's step 5).

:class:`AutoscaledFleet` starts a gateway with no backends and a
:class:`~labkit.autoscale.controller.ProcessAutoscaler` that adds ``labkit serve`` replicas to
it. :func:`step_load` puts closed-loop users on the gateway, each streaming one completion
after another: a few, then many at once (the step), held until the fleet has grown, then none
until it is back to one replica. Every ``sample_s`` it records the requests in flight and the
replicas ready and starting, on ``time.monotonic``, the autoscaler's default clock, so its
timeline lines up with the autoscaler's ``history`` and ``events``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from labkit.autoscale.controller import READY, STARTING, STOPPED, ProcessAutoscaler
from labkit.autoscale.observation import Policy
from labkit.checks import in_range, positive_int
from labkit.http.client import StreamResult, client_pool, stream_completion
from labkit.harness.fleet import gateway_command
from labkit.launch import ServeConfig
from labkit.process import ServerProcess, free_port, group_alive


class AutoscaledFleet:
    """A gateway and the :class:`~labkit.autoscale.controller.ProcessAutoscaler` that scales
    ``labkit serve`` replicas behind it (chapter 5).

    ``policy``, ``serve``, ``max_replicas`` and ``drain_timeout_s`` go to the autoscaler;
    the gateway routes with ``strategy``. ``start()`` starts the gateway, waits until its
    admin API answers (``/health`` says 503 while no backend is routable), then starts the
    autoscaler and its first replica; ``close()`` stops the autoscaler (which removes and
    stops every replica), then the gateway. Use it as a context manager, or call both.
    """

    def __init__(self, policy: Policy, serve: ServeConfig, *, max_replicas: int = 3,
                 drain_timeout_s: float = 10.0, strategy: str = "least_requests") -> None:
        port = free_port()
        self.gateway = ServerProcess(gateway_command([], strategy, port),
                                     f"http://127.0.0.1:{port}", startup_timeout_s=60,
                                     ready_path="/list_workers")
        self.scaler = ProcessAutoscaler(self.gateway.base_url, policy, serve,
                                        max_replicas=max_replicas,
                                        drain_timeout_s=drain_timeout_s)

    @property
    def base_url(self) -> str:
        """Where clients send requests: the gateway."""
        return self.gateway.base_url

    def start(self) -> AutoscaledFleet:
        self.gateway.start()
        try:
            self.scaler.start()
        except BaseException:
            self.gateway.stop()
            raise
        return self

    def close(self) -> None:
        self.scaler.close()
        self.gateway.stop()

    def exited(self) -> bool:
        """Whether every process this fleet started (each replica's process group and the
        gateway's) has exited."""
        pids = {e.pid for e in self.scaler.events if e.pid is not None}
        if self.gateway.process is not None:
            pids.add(self.gateway.process.pid)
        return not any(group_alive(pid) for pid in pids)

    def __enter__(self) -> AutoscaledFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class StepLoad:
    """The load of :func:`step_load` (chapter 5): ``base_users`` closed-loop users, then
    ``step_users`` from ``step_at_s``, held ``hold_s`` once the fleet has grown past one
    replica (at most ``max_hold_s`` if it never does), then none until the fleet is back to
    one ready replica with nothing in flight (at most ``settle_s``). Each request asks for
    ``max_tokens`` tokens; the conductor samples every ``sample_s`` seconds."""

    base_users: int = 2
    step_users: int = 24
    step_at_s: float = 4.0
    hold_s: float = 15.0
    max_hold_s: float = 45.0
    settle_s: float = 40.0
    max_tokens: int = 32
    sample_s: float = 0.25

    def __post_init__(self) -> None:
        positive_int("base_users", self.base_users, at_least=0)
        positive_int("step_users", self.step_users, at_least=max(1, self.base_users))
        positive_int("max_tokens", self.max_tokens)
        in_range("step_at_s", self.step_at_s, 0)
        in_range("hold_s", self.hold_s, 0)
        in_range("max_hold_s", self.max_hold_s, self.hold_s)
        in_range("settle_s", self.settle_s, 0)
        in_range("sample_s", self.sample_s, 0, low_open=True)


@dataclass(frozen=True)
class StepRun:
    """What :func:`step_load` saw: the samples (seconds since ``began_s``, requests in flight
    at the users, replicas ready and starting), when the step came and the load went
    (seconds since ``began_s``), and how every stream ended. ``began_s`` is on
    ``time.monotonic``."""

    load: StepLoad
    began_s: float
    step_at_s: float
    stop_at_s: float
    time_s: np.ndarray
    in_flight: np.ndarray
    ready: np.ndarray
    starting: np.ndarray
    outcomes: tuple[StreamResult, ...]


async def step_load(base_url: str, model: str, scaler: ProcessAutoscaler,
                    load: StepLoad = StepLoad()) -> StepRun:
    """Run ``load`` against the gateway at ``base_url`` while ``scaler`` scales the fleet
    behind it (chapter 5). User ``u`` sends ``"user {u} request {i}: hello"`` for
    ``max_tokens`` tokens, again and again, while the conductor lets ``u`` users run."""
    users, in_flight, done = load.base_users, 0, False
    outcomes: list[StreamResult] = []
    rows: list[tuple[float, int, int, int]] = []
    began = time.monotonic()

    async with client_pool(base_url, load.step_users, timeout_s=60) as (client, _):
        async def user(u: int) -> None:
            nonlocal in_flight
            i = 0
            while not done:
                if u >= users:
                    await asyncio.sleep(0.05)
                    continue
                in_flight += 1
                outcomes.append(await stream_completion(
                    client, model, f"user {u} request {i}: hello", load.max_tokens))
                in_flight -= 1
                i += 1

        async def conductor() -> tuple[float, float]:
            nonlocal users, done
            step_at = stop_at = None
            while True:
                t = time.monotonic() - began
                phases = [r.phase for r in scaler.replicas()]
                ready = phases.count(READY)
                rows.append((t, in_flight, ready, phases.count(STARTING)))
                if step_at is None and t >= load.step_at_s:
                    step_at, users = t, load.step_users
                elif step_at is not None and stop_at is None:
                    grown = max(row[2] for row in rows) > 1
                    if (grown and t - step_at >= load.hold_s) or t - step_at > load.max_hold_s:
                        stop_at, users = t, 0
                elif stop_at is not None:
                    settled = ready == 1 and set(phases) <= {READY, STOPPED}
                    if (settled and in_flight == 0) or t - stop_at > load.settle_s:
                        done = True
                        return step_at, stop_at
                await asyncio.sleep(load.sample_s)

        (step_at, stop_at), *_ = await asyncio.gather(
            conductor(), *(user(u) for u in range(load.step_users)))
    time_s, in_flight_n, ready_n, starting_n = (np.array(c) for c in zip(*rows, strict=True))
    return StepRun(load, began, step_at, stop_at, time_s, in_flight_n, ready_n, starting_n,
                   tuple(outcomes))
