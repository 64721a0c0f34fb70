"""Everything a gateway is told, in one record (chapter 5: :ref:`ch05-choosing-backend`,
:ref:`ch05-backend-dies`).

:class:`GatewayConfig` holds the routing strategy, the limits and timeouts of the proxy, how
often the pool scrapes and probes its backends, and when it ejects and re-admits one. The
proxy (:class:`labkit.gateway.server.Gateway`) and its pool
(:class:`labkit.gateway.backends.BackendPool`) both read it; ``labkit gateway``'s flags fill
it. Each default names where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.routing import STRATEGIES, Router

#: The same 4 MiB as ``labkit serve``: the gateway refuses what a backend would refuse before
#: it travels any further.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

#: vllm-router's HTTP client (vllm-project/router ``src/server.rs``): connect timeout 10 s,
#: whole-request timeout ``request_timeout_secs`` = 1800 s (vllm-router 0.1.17,
#: ``router_args.py``). We bound each read instead of the whole request (a long stream is
#: fine as long as tokens keep coming); 1800 s keeps that bound as loose as theirs.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 1800.0

#: The Gateway API Inference Extension's endpoint picker scrapes every 50 ms
#: (``defaultRefreshMetricsInterval``, kubernetes-sigs/gateway-api-inference-extension,
#: ``cmd/epp/runner/options.go``, main branch 2025), because queue depth and KV-cache use
#: change within a second. We scrape every 250 ms: on a 2-core laptop a busy teaching server
#: can take 300 ms to answer ``/metrics``, and three backends scraped 20 times a second take a
#: visible share of a core.
DEFAULT_SCRAPE_INTERVAL_S = 0.25
#: Metrics older than this many scrape intervals are stale (upstream: 200 ms / 50 ms = 4).
STALE_AFTER_INTERVALS = 4
#: Ours: vllm-router probes every 60 s (``health_check_interval_secs``, 0.1.17); on one
#: machine a loopback probe costs well under a millisecond, and once a second lets a lab
#: watch a dead backend leave and come back within seconds.
DEFAULT_PROBE_INTERVAL_S = 1.0
#: vllm-router's ``health_check_timeout_secs`` (0.1.17); scrapes get the same bound.
DEFAULT_PROBE_TIMEOUT_S = 5.0
#: vllm-router's ``health_failure_threshold`` and ``health_success_threshold`` (0.1.17).
DEFAULT_EJECT_AFTER, DEFAULT_READMIT_AFTER = 3, 2

#: vllm-router's ``worker_startup_timeout_secs`` (0.1.17).
DEFAULT_WORKER_STARTUP_TIMEOUT_S = 600.0
#: How long a drain waits for open requests: Kubernetes' default grace period between SIGTERM
#: and SIGKILL (``terminationGracePeriodSeconds``, "Defaults to 30 seconds", PodSpec, k8s.io
#: API reference), the time a replica has to finish its requests when it is scaled down.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GatewayConfig:
    """How one gateway routes, limits, times out and judges its backends (chapter 5).

    * **routing**: ``strategy`` names a router of
      ``labkit.gateway.routing.STRATEGIES`` (built with ``seed``) or is a
      :class:`~labkit.gateway.routing.Router` itself (then ``seed`` is unused);
      ``session_header`` names the header that carries a session id (consistent hashing);
    * **the proxy**: ``api_key`` (if set) is required on ``/v1`` and the admin routes; bodies
      over ``max_request_bytes`` get 413; each attempt waits at most ``connect_timeout_s`` to
      connect and ``read_timeout_s`` for each read;
    * **the pool** (:class:`~labkit.gateway.backends.BackendPool`): each backend's
      ``/metrics`` is scraped every ``scrape_interval_s`` and its ``/health`` probed every
      ``probe_interval_s``, each within ``probe_timeout_s``; ``eject_after`` consecutive
      failures eject it, ``readmit_after`` consecutive good probes re-admit it;
    * **the admin API**: it waits up to ``worker_startup_timeout_s`` for a new backend's
      health, and up to ``drain_timeout_s`` for a leaving one's open requests.

    Bad values raise :class:`~labkit.checks.ParameterError` naming the field.
    """

    strategy: str | Router = "endpoint_picker"
    seed: int | None = None
    session_header: str = "x-session-id"
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    eject_after: int = DEFAULT_EJECT_AFTER
    readmit_after: int = DEFAULT_READMIT_AFTER
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    worker_startup_timeout_s: float = DEFAULT_WORKER_STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Router) and self.strategy not in STRATEGIES:
            raise ParameterError("strategy", f"strategy must be one of {', '.join(STRATEGIES)}"
                                             f" or a Router, got {self.strategy!r}")
        if not isinstance(self.session_header, str) or not self.session_header:
            raise ParameterError("session_header", "session_header must be a header name, "
                                                   f"got {self.session_header!r}")
        positive_int("max_request_bytes", self.max_request_bytes)
        for name in ("connect_timeout_s", "read_timeout_s", "scrape_interval_s",
                     "probe_interval_s", "probe_timeout_s"):
            in_range(name, getattr(self, name), 0, low_open=True)
        positive_int("eject_after", self.eject_after)
        positive_int("readmit_after", self.readmit_after)
        in_range("drain_timeout_s", self.drain_timeout_s, 0)
        in_range("worker_startup_timeout_s", self.worker_startup_timeout_s, 0)

    @property
    def metrics_staleness_s(self) -> float:
        """Seconds after which a backend's scraped figures are stale: upstream's ratio,
        ``STALE_AFTER_INTERVALS`` scrape intervals, at this gateway's interval."""
        return STALE_AFTER_INTERVALS * self.scrape_interval_s
