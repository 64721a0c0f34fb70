"""A health checker with consecutive-failure state (:ref:`ch08-health-checks`).

One failed ``GET /health`` says little (a garbage-collection pause, a full accept queue);
several in a row say the server is gone. The checker therefore marks a server down after
``eject_after`` consecutive failed probes and up again after ``readmit_after`` consecutive
good ones. That is exactly the gateway's ejection state machine (chapter 5), so this module
drives :class:`labkit.gateway.backends.BackendPool` rather than keeping a second copy: the
same probe (a 200 within the timeout), the same counters, the same defaults, vllm-router's
``health_failure_threshold`` = 3 and ``health_success_threshold`` = 2 (vllm-router 0.1.17,
``vllm_router/router_args.py``). What it adds is time: every check and every transition is
stamped on an injected clock, so a lab can plot when a server went down and a test can
script it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from labkit.checks import ParameterError
from labkit.gateway.backends import BackendPool
from labkit.gateway.config import (DEFAULT_EJECT_AFTER, DEFAULT_PROBE_TIMEOUT_S,
                                   DEFAULT_READMIT_AFTER, GatewayConfig)
from labkit.gateway.endpoints import Endpoint


@dataclass(frozen=True)
class HealthStatus:
    """One server's state after a check."""

    url: str
    healthy: bool                 # False from eject_after failures until readmit_after goods
    probe_ok: bool                # the last probe's own answer
    consecutive_failures: int
    consecutive_successes: int    # counted only while down (towards re-admission)
    t_s: float                    # the check's time on the checker's clock


@dataclass(frozen=True)
class HealthTransition:
    """A server going down (``healthy`` False) or coming back, at ``t_s``."""

    url: str
    healthy: bool
    t_s: float


class HealthChecker:
    """Probes ``urls``' ``/health`` with one shared client and keeps each server's state
    (chapter 8). A server counts as up until ``eject_after`` probes in a row fail.
    Bad thresholds or URLs raise :class:`~labkit.checks.ParameterError` (from the pool).
    """

    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient, *,
                 eject_after: int = DEFAULT_EJECT_AFTER,
                 readmit_after: int = DEFAULT_READMIT_AFTER,
                 timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.transitions: list[HealthTransition] = []
        self._now = 0.0
        config = GatewayConfig(eject_after=eject_after, readmit_after=readmit_after,
                               probe_timeout_s=timeout_s)
        self._pool = BackendPool(urls, config, on_eject=lambda e: self._record(e, False),
                                 on_readmit=lambda e: self._record(e, True))

    def _record(self, endpoint: Endpoint, healthy: bool) -> None:
        self.transitions.append(HealthTransition(endpoint.url, healthy, self._now))

    async def check(self) -> list[HealthStatus]:
        """Probe every server once, concurrently, and update its state."""
        self._now = now = self.clock()
        endpoints = list(self._pool.endpoints)
        answers = await asyncio.gather(*(self._pool.healthy_now(self.client, e.url)
                                         for e in endpoints))
        statuses = []
        for endpoint, ok in zip(endpoints, answers, strict=True):
            if ok:
                self._pool.record_success(endpoint, probe=True)
            else:
                self._pool.record_failure(endpoint)
            statuses.append(HealthStatus(endpoint.url, endpoint.healthy, ok,
                                         endpoint.consecutive_failures,
                                         endpoint.consecutive_successes, now))
        return statuses

    def healthy(self, url: str) -> bool:
        """Whether ``url`` is up now (:class:`~labkit.checks.ParameterError` if unknown)."""
        endpoint = self._pool.get(url)
        if endpoint is None:
            raise ParameterError("url", f"url must be one of the checked servers, got {url!r}")
        return endpoint.healthy
