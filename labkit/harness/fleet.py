"""Fleets of real servers for the gateway labs (chapter 5, :ref:`ch05-backend-dies`).

Lab 05, lab 08 and ``benchmarks/gateway_prefix.py`` put the same fleet under the same loads:
``labkit serve`` processes of one model on free loopback ports (:class:`BackendFleet`), which a
lab can crash (SIGKILL, as the OOM killer would) and start again on the same port, and a
gateway in front (:func:`start_gateway`, a ``labkit gateway`` process; vllm-router's is
:func:`labkit.harness.vllm_router.start_router`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.routing import STRATEGIES
from labkit.launch import ServeConfig, command_for
from labkit.process import ServerProcess, free_port, kill_group


class BackendFleet:
    """``size`` ``labkit serve`` processes of ``model`` on free loopback ports (chapter 5).

    ``max_num_seqs`` sizes each backend's running batch: one number for all, or one per
    backend (a smaller one stands in for a weaker GPU), ``None`` for the engine's default.
    Start it with :meth:`start` or ``with``; :meth:`kill` crashes one (SIGKILL to its
    process group: no graceful shutdown), :meth:`restart` starts it again on the same port,
    :meth:`stop` stops them all. Start and restart from the thread that will outlive the
    servers: :class:`~labkit.process.ServerProcess` asks Linux to stop a server when the
    thread that started it ends.
    """

    def __init__(self, model: str, size: int = 3, *, served_model_name: str = "course-model",
                 max_model_len: int | None = 1024,
                 max_num_seqs: int | Sequence[int | None] | None = None,
                 startup_timeout_s: float = 120) -> None:
        positive_int("size", size)
        if max_num_seqs is None or isinstance(max_num_seqs, int):
            max_num_seqs = [max_num_seqs] * size
        if len(max_num_seqs) != size:
            raise ParameterError("max_num_seqs", f"max_num_seqs must be one number or {size} "
                                                 f"(one per backend), got {max_num_seqs!r}")
        ports: list[int] = []
        while len(ports) < size:  # free_port() may hand out a just-closed port twice
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.configs = [ServeConfig(model=model, served_model_name=served_model_name,
                                    port=port, max_model_len=max_model_len, max_num_seqs=seqs)
                        for port, seqs in zip(ports, max_num_seqs, strict=True)]
        self.startup_timeout_s = in_range("startup_timeout_s", startup_timeout_s, 0,
                                          low_open=True)
        self.servers: list[ServerProcess | None] = [None] * size

    @property
    def urls(self) -> list[str]:
        """The backends' base URLs, in order."""
        return [cfg.base_url for cfg in self.configs]

    @property
    def model(self) -> str:
        """The name the backends serve the model under."""
        return self.configs[0].name

    def start(self) -> BackendFleet:
        """Start every backend that is not running, one after the other."""
        for i in range(len(self.configs)):
            if not self.alive(i):
                self.restart(i)
        return self

    def alive(self, i: int) -> bool:
        """True while backend ``i``'s process runs."""
        server = self.servers[self._index(i)]
        return server is not None and server.process.poll() is None

    def kill(self, i: int) -> None:
        """Crash backend ``i``: SIGKILL to its process group, as the OOM killer would."""
        if not self.alive(i):
            raise ParameterError("i", f"backend {i} is not running")
        kill_group(self.servers[i].process)

    def restart(self, i: int) -> None:
        """Start backend ``i`` again on its port (with empty caches and counters at 0) and
        wait until it answers ``/health``."""
        cfg = self.configs[self._index(i)]
        if self.alive(i):
            raise ParameterError("i", f"backend {i} is still running")
        self.servers[i] = ServerProcess(command_for("labkit", cfg), cfg.base_url,
                                        self.startup_timeout_s).start()

    def stop(self) -> None:
        """Stop every backend (SIGTERM, SIGKILL after a grace period)."""
        for server in self.servers:
            if server is not None:
                server.stop()

    def restart_all(self) -> None:
        """Stop every backend and start it again on its port: empty prefix caches and
        counters at 0, so that the next run owes nothing to the previous one."""
        self.stop()
        self.start()

    def _index(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.configs):
            raise ParameterError("i", f"i must be a backend index in [0, {len(self.configs)}),"
                                      f" got {i!r}")
        return i

    def __enter__(self) -> BackendFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def gateway_command(backends: Sequence[str], strategy: str, port: int, *,
                    seed: int | None = None, host: str = "127.0.0.1") -> list[str]:
    """The ``labkit gateway`` command line in front of ``backends`` with ``strategy`` (one of
    ``labkit.gateway.STRATEGIES``), run with this Python (chapter 5)."""
    if not backends:
        raise ParameterError("backends", "backends must name at least one server URL")
    if strategy not in STRATEGIES:
        raise ParameterError("strategy", f"strategy must be one of {', '.join(STRATEGIES)}, "
                                         f"got {strategy!r}")
    in_range("port", port, 1, 65535)
    command = [sys.executable, "-m", "labkit.cli", "gateway", "--strategy", strategy,
               "--host", host, "--port", str(port)]
    if seed is not None:
        command += ["--seed", str(seed)]
    for url in backends:
        command += ["--backend", url]
    return command


def start_gateway(backends: Sequence[str], strategy: str = "endpoint_picker", *,
                  seed: int | None = 0, port: int | None = None,
                  startup_timeout_s: float = 60) -> ServerProcess:
    """Start ``labkit gateway`` on a free loopback port and return it, started, once
    ``/health`` says a backend is routable; stop it with ``stop()`` (chapter 5)."""
    port = free_port() if port is None else port
    return ServerProcess(gateway_command(backends, strategy, port, seed=seed),
                         f"http://127.0.0.1:{port}", startup_timeout_s).start()
