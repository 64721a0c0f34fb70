"""Everything a gateway is told, in one record (chapter 5: :ref:`ch05-choosing-backend`,
:ref:`ch05-backend-dies`).

:class:`GatewayConfig` holds the routing strategy, the limits and timeouts of the proxy, how
often the pool scrapes and probes its backends, and when it ejects and re-admits one. The
proxy (:class:`labkit.gateway.server.Gateway`) and its pool
(:class:`labkit.gateway.backends.BackendPool`) both read it; ``labkit gateway``'s flags fill
it. Each default names where it comes from.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.routing import STRATEGIES, Router

#: The same 4 MiB as ``labkit serve``: the gateway refuses what a backend would refuse before
#: it travels any further.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

#: vllm-router's HTTP client (vllm-project/router ``src/server.rs``): connect timeout 10 s,
#: whole-request timeout ``request_timeout_secs`` = 1800 s (vllm-router 0.1.17,
#: ``router_args.py``). We bound each read instead of the whole request (a long stream is
#: fine as long as tokens keep coming); 1800 s keeps that bound as loose as theirs. It is the
#: only bound on a non-streamed answer, which vLLM sends whole when it is complete: before
#: then a long answer and a hung backend look the same.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 1800.0
#: Ours. How long one attempt of a streamed request may wait for its first event (the
#: backend's queue, then the prompt's prefill) before the gateway gives up on that backend
#: and tries another: nothing has reached the client, so the retry cannot duplicate a token.
#: A 128k-token prompt on Llama-3-70B is about 4e16 FLOPs of prefill (2 x parameters per
#: token, plus about as much again for causal attention at that length: 2 x layers x
#: length^2 x hidden size), some 20 s on four H100s at half their dense BF16 peak; 60 s
#: leaves room for a queue too. Envoy (docs/root/faq/configuration/timeouts.rst): its route
#: ``timeout`` (15 s by default, until the response is complete) "will need to be disabled"
#: for streaming responses; its ``per_try_timeout`` is the per-attempt analogue of this one,
#: but it ends once response headers arrive, and vLLM sends a stream's headers before its
#: first token: a backend stuck in its queue would pass it. Ours waits for the first event.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 60.0
#: Ours. How long a relayed stream may go without a byte before the gateway cuts it, with
#: the same error event as a crash. A healthy stream's gaps are one decode step (10-100 ms),
#: or one chunked-prefill step of another request when it is scheduled beside them (vLLM caps
#: a step's tokens, so well under a second on a GPU); 10 s is a hundred of those. Envoy's
#: ``stream_idle_timeout`` (5 min by default) and its route's ``idle_timeout`` and
#: ``per_try_idle_timeout`` play this role for generic traffic. Shorter than the probes'
#: 3 x 5 s, so a hung backend that was streaming is noticed by its streams first.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 10.0

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
      connect and ``read_timeout_s`` for each read; a streamed attempt waits at most
      ``first_byte_timeout_s`` for its first event (then the request goes to another
      backend) and a relayed stream at most ``stream_idle_timeout_s`` between two reads (then
      it is cut with an error event); each timeout counts as a failure of the backend;
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
    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
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
        for name in ("connect_timeout_s", "read_timeout_s", "first_byte_timeout_s",
                     "stream_idle_timeout_s", "scrape_interval_s", "probe_interval_s",
                     "probe_timeout_s"):
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


def check_exposure(host: str, api_key: str | None, open_admin_routes: bool = False) -> None:
    """Refuse to serve the admin routes unprotected beyond this machine (chapter 5).

    ``POST /add_worker`` makes the gateway send its clients' requests, prompts and all, to
    any URL it is given: on a shared network, anyone who can reach an open gateway can add a
    server of their own and read every prompt, or point it at an internal address only the
    gateway can reach. Bound to a loopback address (the default) only this machine can; any
    other ``host`` needs an ``api_key`` (which guards ``/v1`` and the admin routes) or an
    explicit ``open_admin_routes``. Raises :class:`~labkit.checks.ParameterError` naming
    ``host``.
    """
    if api_key or open_admin_routes:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        loopback = False
    if not loopback:
        raise ParameterError(
            "host", f"binding {host!r} would open the admin routes (/add_worker, "
                    "/remove_worker) to the network, and /add_worker sends clients' requests "
                    "to any URL it is given: pass --api-key KEY to guard them, or "
                    "--open-admin-routes to open them on purpose")
