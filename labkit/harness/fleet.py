"""Fleets of real servers for the gateway labs (chapter 5, :ref:`ch05-backend-dies`).

Lab 05, lab 08 and ``benchmarks/gateway_prefix.py`` put the same fleet under the same loads:
``labkit serve`` processes of one model on free loopback ports (:class:`BackendFleet`), which a
lab can crash (SIGKILL, as the OOM killer would) and start again on the same port, and a
gateway in front (:func:`start_gateway`, a ``labkit gateway`` process; vllm-router's is
:func:`labkit.harness.vllm_router.start_router`).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping, Sequence

from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.routing import STRATEGIES
from labkit.launch import ServeConfig, command_for
from labkit.process import ServerProcess, free_port, kill_group, signal_group


class BackendFleet:
    """``size`` ``labkit serve`` processes of ``model`` on free loopback ports (chapter 5).

    ``max_num_seqs`` sizes each backend's running batch: one number for all, or one per
    backend (a smaller one stands in for a weaker GPU), ``None`` for the engine's default.
    Start it with :meth:`start` or ``with``; :meth:`kill` crashes one (SIGKILL to its
    process group: no graceful shutdown), :meth:`pause` hangs one (SIGSTOP) until
    :meth:`resume`, :meth:`restart` starts it again on the same port,
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

    def pause(self, i: int) -> None:
        """Hang backend ``i``: SIGSTOP to its process group. It stays alive and its port
        keeps accepting connections (the kernel completes the handshake), but nothing
        answers: a wedged GPU, a process swapped out, a partition. :meth:`resume` ends it."""
        self._signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """End :meth:`pause`: SIGCONT to backend ``i``'s process group."""
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: signal.Signals) -> None:
        if not self.alive(i):
            raise ParameterError("i", f"backend {i} is not running")
        signal_group(self.servers[i].process.pid, sig)

    def restart(self, i: int) -> None:
        """Start backend ``i`` again on its port (with empty caches and counters at 0) and
        wait until it answers ``/health``."""
        cfg = self.configs[self._index(i)]
        if self.alive(i):
            raise ParameterError("i", f"backend {i} is still running")
        self.servers[i] = ServerProcess(command_for("labkit", cfg), cfg.base_url,
                                        self.startup_timeout_s).start()

    def stop(self) -> None:
        """Stop every backend (SIGTERM, SIGKILL after a grace period); a paused one is
        resumed first, since a stopped process cannot handle its SIGTERM."""
        for i, server in enumerate(self.servers):
            if server is not None:
                if self.alive(i):
                    self.resume(i)
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
                    seed: int | None = None, host: str = "127.0.0.1",
                    timeouts: Mapping[str, float] | None = None) -> list[str]:
    """The ``labkit gateway`` command line in front of ``backends`` with ``strategy`` (one of
    ``labkit.gateway.STRATEGIES``), run with this Python (chapter 5). With no ``backends`` the
    gateway starts empty, for an autoscaler to fill through ``/add_worker``. ``timeouts``
    maps ``first_byte`` and ``stream_idle`` to seconds (the gateway's defaults otherwise)."""
    timeouts = dict(timeouts or {})
    unknown = set(timeouts) - {"first_byte", "stream_idle"}
    if unknown:
        raise ParameterError("timeouts", f"timeouts takes first_byte and stream_idle, got "
                                         f"{sorted(unknown)}")
    if strategy not in STRATEGIES:
        raise ParameterError("strategy", f"strategy must be one of {', '.join(STRATEGIES)}, "
                                         f"got {strategy!r}")
    in_range("port", port, 1, 65535)
    command = [sys.executable, "-m", "labkit.cli", "gateway", "--strategy", strategy,
               "--host", host, "--port", str(port)]
    if seed is not None:
        command += ["--seed", str(seed)]
    for kind, seconds in timeouts.items():
        command += [f"--{kind.replace('_', '-')}-timeout",
                    str(in_range(f"timeouts[{kind!r}]", seconds, 0, low_open=True))]
    for url in backends:
        command += ["--backend", url]
    return command


def start_gateway(backends: Sequence[str], strategy: str = "endpoint_picker", *,
                  seed: int | None = 0, port: int | None = None,
                  timeouts: Mapping[str, float] | None = None,
                  startup_timeout_s: float = 60) -> ServerProcess:
    """Start ``labkit gateway`` on a free loopback port and return it, started, once
    ``/health`` says a backend is routable (with no ``backends``, once its admin API
    answers: ``/health`` is 503 until one is added); stop it with ``stop()`` (chapter 5)."""
    port = free_port() if port is None else port
    return ServerProcess(gateway_command(backends, strategy, port, seed=seed,
                                         timeouts=timeouts),
                         f"http://127.0.0.1:{port}", startup_timeout_s,
                         ready_path="/health" if backends else "/list_workers").start()
