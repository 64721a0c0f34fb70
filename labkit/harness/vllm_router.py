"""The vLLM project's production router, started beside labkit's gateway
(chapter 5, :ref:`ch05-backend-dies`).

``vllm-router`` (PyPI ``vllm-router``, a Rust binary wheel that runs on CPU) is the router the
vLLM project ships for fleets of ``vllm serve`` workers. Chapter 5 starts it in front of the
same ``labkit serve`` backends as :mod:`labkit.gateway` and compares the two. This module
renders its command line and starts it as a :class:`~labkit.process.ServerProcess`.

What it does, read from its 0.1.17 wheel (``vllm_router/router_args.py``) and seen on
loopback in front of ``labkit serve``:

- **Policies** (``--policy``, default ``cache_aware``): ``round_robin``; ``random``;
  ``power_of_two`` (two random workers, the one with fewer requests in flight; it also polls
  ``GET /get_load`` on each worker every 5 s, an SGLang route that vLLM's server lacks, and
  makes do with its own counts on a 404); ``consistent_hash`` (a hash ring with virtual
  nodes, keyed on the ``x-session-id``, ``x-user-id``, ... headers, then the ``user`` or
  ``session_id`` body fields, then the request itself); ``cache_aware`` (an approximate radix
  tree of the prompts each worker was sent: the longest match wins when it covers more than
  ``cache_threshold`` = 0.3 of the prompt, the least loaded worker otherwise, and least-load
  alone once loads differ by more than ``balance_abs_threshold`` = 64 requests *and* a factor
  ``balance_rel_threshold`` = 1.5); ``kv_aware`` (scores workers from vLLM's KV-cache
  events) and ``sticky_least_loaded`` (a new session goes to the worker with the fewest
  active sessions and stays there).
- **Worker routes it calls**: ``GET /health`` at startup and every
  ``health_check_interval_secs`` (default 60 s); the OpenAI routes it forwards; and, for
  ``cache_aware``, ``POST /v1/completions/render`` (vLLM's renderer, off by default) then
  ``POST /tokenize``. With token ids the tree is keyed on tokens (the match rates it logs
  are shared tokens over prompt tokens), without them on characters: that is why
  ``labkit serve`` has ``/tokenize``. Any other path is passed through to one worker.
- **Failures**: a request that cannot reach its worker is retried on another
  (``retry_max_retries`` = 5, backoff from 50 ms), so a crash loses no request that had not
  started; a worker's circuit breaker opens after ``cb_failure_threshold`` = 10 failures and
  is tried again after ``cb_timeout_duration_secs`` = 60 s; a worker is ejected after
  ``health_failure_threshold`` = 3 failed probes and re-admitted after
  ``health_success_threshold`` = 2 good ones. Its ``/health`` answers 503 while any worker
  is out, ``/readiness`` 200 while one is in. A stream whose worker dies mid-way is cut: the
  client gets neither an error event nor ``[DONE]``.
- **Metrics**: Prometheus text on a port of its own (``--prometheus-port``, default 29000);
  the router's ``/metrics`` is passed through to a worker.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from labkit.checks import ParameterError, in_range
from labkit.process import ServerProcess, free_port

#: The ``--policy`` choices of vllm-router 0.1.17 (``vllm_router/router_args.py``).
POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
            "consistent_hash", "sticky_least_loaded")

# Flags router_command writes itself from its named arguments.
_OWN_FLAGS = ("worker_urls", "policy", "host", "port")


def router_command(backends: Sequence[str], policy: str, port: int, host: str = "127.0.0.1",
                   **options) -> list[str]:
    """The command line that starts vllm-router on ``host:port`` in front of ``backends``
    (base URLs such as ``http://127.0.0.1:8001``) with ``policy``, one of :data:`POLICIES`.

    ``options`` are the router's other flags by their Python names:
    ``health_check_interval_secs=1`` becomes ``--health-check-interval-secs 1``, ``True``
    writes a bare flag (``disable_retries=True``), a list writes several values, ``None`` and
    ``False`` write nothing. The command runs the module behind the ``vllm-router`` console
    script with this Python, so it needs no ``PATH``. Chapter 5.
    """
    if not backends:
        raise ParameterError("backends", "backends must name at least one worker URL")
    for url in backends:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ParameterError("backends", f"backends must be http(s) base URLs, got {url!r}")
    if policy not in POLICIES:
        raise ParameterError("policy", f"policy must be one of {POLICIES}, got {policy!r}")
    in_range("port", port, 1, 65535)
    command = [sys.executable, "-m", "vllm_router.launch_router", "--host", host,
               "--port", str(port), "--policy", policy, "--worker-urls", *backends]
    for name, value in options.items():
        if name in _OWN_FLAGS:
            raise ParameterError(name, f"{name} is set by router_command's own arguments")
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            command.append(flag)
        elif isinstance(value, (list, tuple)):
            command += [flag, *map(str, value)]
        else:
            command += [flag, str(value)]
    return command


class RouterProcess(ServerProcess):
    """A running vllm-router: a :class:`~labkit.process.ServerProcess` (ready once its
    ``/health`` answers 200, stopped with its process group) that also knows where its
    Prometheus metrics are."""

    def __init__(self, command: Sequence[str], base_url: str, metrics_url: str,
                 startup_timeout_s: float) -> None:
        super().__init__(command, base_url, startup_timeout_s)
        self.metrics_url = metrics_url


def start_router(backends: Sequence[str], policy: str, port: int | None = None,
                 host: str = "127.0.0.1", startup_timeout_s: float = 60,
                 **options) -> RouterProcess:
    """Start vllm-router in front of ``backends`` and return it once it answers.

    ``port`` defaults to a free one. ``options`` are :func:`router_command`'s; unless
    ``prometheus_port`` is among them, the metrics go to a free port too, since the router's
    default (29000) would collide with a second router on the same machine. Start the
    backends first: the router listens once one of them answers ``/health`` (it checks every
    ``worker_startup_check_interval``, 30 s by default) and exits if none has within
    ``worker_startup_timeout_secs`` (600 s), which this function reports as a
    ``RuntimeError`` with the router's log. Stop it with ``stop()`` or use it as a context
    manager. Chapter 5.
    """
    in_range("startup_timeout_s", startup_timeout_s, 0, low_open=True)
    port = free_port() if port is None else port
    if "prometheus_port" not in options:
        # Two free_port() calls in a row may return the same port (the first socket is
        # closed again): the router then fails to bind its metrics listener.
        options["prometheus_port"] = next(p for p in iter(free_port, None) if p != port)
    if options["prometheus_port"] == port:
        raise ParameterError("prometheus_port", f"prometheus_port must differ from port "
                                                f"({port})")
    command = router_command(backends, policy, port, host, **options)
    metrics_host = _reachable(options.get("prometheus_host") or "127.0.0.1")
    router = RouterProcess(command, f"http://{_reachable(host)}:{port}",
                           f"http://{metrics_host}:{options['prometheus_port']}/metrics",
                           startup_timeout_s)
    return router.start()


def _reachable(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host
