"""Server processes: started in their own process group, waited for, stopped whole
(:ref:`ch02-streaming`, chapters 5 and 8).

Every server a lab, a test or a harness starts (``labkit serve``, vLLM, the gateway,
vllm-router, Prometheus) goes through :class:`ServerProcess`: its own process group, so an
engine's worker processes stop with it; a log file to read when it fails; readiness polled
on the route the server answers when it can serve (``/health`` for OpenAI servers,
``/-/ready`` for Prometheus); and, on Linux, the parent-death signal, so a killed notebook
kernel or test run leaves no server behind. :func:`wait_until` is the one polling loop for
"until this is true or the deadline passes" (:func:`wait_until_async` in an event loop);
:func:`exit_on_sigterm` lets a script that started servers stop them when it is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import httpx

from labkit.checks import in_range


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0,
               interval_s: float = 0.2, what: str = "the condition") -> float:
    """Poll ``predicate()`` until it is true; return the seconds waited. Raise
    ``TimeoutError`` naming ``what`` after ``timeout_s`` (a backend's ejection takes a few
    probes, a vLLM start a minute)."""
    in_range("timeout_s", timeout_s, 0)
    in_range("interval_s", interval_s, 0, low_open=True)
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} still not true after {timeout_s:g} s")
        time.sleep(interval_s)
    return time.monotonic() - start


async def wait_until_async(predicate: Callable[[], object], timeout_s: float = 30.0,
                           interval_s: float = 0.2, what: str = "the condition") -> float:
    """:func:`wait_until` for an event loop: ``predicate`` may be a coroutine function (a
    health probe); between polls the loop runs other tasks. Returns the seconds waited;
    ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    in_range("timeout_s", timeout_s, 0)
    in_range("interval_s", interval_s, 0, low_open=True)
    start = time.monotonic()
    while True:
        done = predicate()
        if inspect.isawaitable(done):
            done = await done
        if done:
            return time.monotonic() - start
        left_s = timeout_s - (time.monotonic() - start)
        if left_s <= 0:
            raise TimeoutError(f"{what} still not true after {timeout_s:g} s")
        await asyncio.sleep(min(interval_s, left_s))


def parent_death_hook(thread_outlives_child: bool = False) -> Callable[[], None] | None:
    """``preexec_fn`` for a server started from this thread: :func:`die_with_parent` on the
    main thread, or on any thread that ``thread_outlives_child`` (it lives as long as the
    server: the autoscaler's replica threads do); none elsewhere. Linux sends the
    parent-death signal when the *thread* that forked the child exits, so a server started
    from a short-lived worker thread (``asyncio.to_thread``, a thread pool) would die with
    that thread; such servers are stopped by their owners."""
    on_main = threading.current_thread() is threading.main_thread()
    return die_with_parent if on_main or thread_outlives_child else None


def die_with_parent() -> None:
    """In the child, before the server starts: on Linux, ask for SIGTERM when the process that
    started it dies, so a killed notebook kernel or test run leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid`` (a server started with
    ``start_new_session=True`` leads its own, so its pid is its group's id); False when the
    group is gone already, which is no error: it may exit on its own meanwhile. Signal 0
    sends nothing and only asks whether the group still exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs (signal 0)."""
    return signal_group(pgid, 0)


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM (what ``kill``, systemd and Kubernetes send) raises
    ``SystemExit(128 + 15)`` in the main thread, as Ctrl-C raises ``KeyboardInterrupt``: the
    ``with`` blocks inside unwind and stop what they started (an autoscaler drains and stops
    its replicas), where Python's default would end the process on the spot. The previous
    handler comes back on exit. Call it from the main thread."""
    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the whole process group ``process`` leads (it was started with
    ``start_new_session=True``) and reap it; a group already gone is fine."""
    if signal_group(process.pid, sig):
        process.wait()


class ServerProcess:
    """A server subprocess: started in its own process group, ready, then stopped whole.

        with ServerProcess(command_for("labkit", cfg), cfg.base_url) as server:
            ...  # server.base_url answers OpenAI requests

    ``env`` adds variables to the server's environment (vLLM on CPU reads its KV-cache size
    from one); ``ready_path`` is the route that answers 200 once it can serve. The server
    dies with this process (:func:`die_with_parent`) when it is started from the main
    thread, or from a thread that lives as long as it does (``thread_outlives_server``).
    :meth:`attach` wraps a server that somebody else started and will stop.
    """

    def __init__(self, command: Sequence[str], base_url: str, startup_timeout_s: float = 600,
                 env: Mapping[str, str] | None = None, ready_path: str = "/health",
                 thread_outlives_server: bool = False):
        self.command, self.base_url = list(command), base_url
        self.thread_outlives_server = thread_outlives_server
        self.startup_timeout_s = in_range("startup_timeout_s", startup_timeout_s, 0,
                                          low_open=True)
        self.env = dict(env or {})
        self.ready_path = ready_path
        self.process: subprocess.Popen | None = None
        self.owned = True
        # The server's output goes to a temporary file while it runs; stop() keeps its lines
        # (log_lines() still answers) and removes the file, so a run of servers leaves none.
        self.log_path: str | None = None
        self._final_log: list[str] | None = None
        #: Seconds from the start of the process to its first ready answer (None until then,
        #: and for an attached server): the load time a startup probe is sized from.
        self.ready_after_s: float | None = None

    @classmethod
    def attach(cls, base_url: str, log_path: str | None = None,
               ready_path: str = "/health") -> ServerProcess:
        """A ready server started elsewhere (one vLLM shared by every lab of a test run):
        :meth:`stop` leaves it running."""
        server = cls([], base_url, ready_path=ready_path)
        server.owned = False
        server.log_path = log_path
        if not server.ready():
            raise RuntimeError(f"the server at {base_url} is not ready "
                               f"({ready_path} does not answer 200)")
        return server

    def ready(self, timeout_s: float = 2.0) -> bool:
        """Whether ``ready_path`` answers 200 now."""
        try:
            return httpx.get(self.base_url + self.ready_path, timeout=timeout_s,
                             trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> ServerProcess:
        """Start the server and wait until it is ready; a server already running is kept
        (``with`` on a started server does not start a second one)."""
        if self.process is not None and self.process.poll() is None:
            return self
        if self.log_path is None:
            with tempfile.NamedTemporaryFile("w", prefix="server-", suffix=".log",
                                             delete=False) as log:
                self.log_path = log.name
        self._final_log = None
        started = time.monotonic()
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            preexec_fn=parent_death_hook(
                                                self.thread_outlives_server),
                                            env={**os.environ, **self.env})

        def up() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with code {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            return self.ready()

        try:
            wait_until(up, self.startup_timeout_s, 0.25, what=f"{self.base_url} ready")
        except RuntimeError:
            self.stop()
            raise
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"server not ready after {self.startup_timeout_s} s:\n"
                               f"{self.log_tail()}") from None
        self.ready_after_s = time.monotonic() - started
        return self

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM the whole process group (engines spawn workers), SIGKILL after grace;
        then the log's lines are kept in memory and its file removed."""
        if not self.owned or self.process is None:
            return
        if self.process.poll() is None:
            group = os.getpgid(self.process.pid)
            os.killpg(group, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(group, signal.SIGKILL)
                self.process.wait()
        if self.log_path is not None and os.path.exists(self.log_path):
            self._final_log = self.log_lines()
            os.unlink(self.log_path)

    def log_lines(self) -> list[str]:
        """Every line the server wrote so far (after :meth:`stop`, all it wrote)."""
        if self._final_log is not None:
            return list(self._final_log)
        if self.log_path is None:
            return []
        with open(self.log_path, errors="replace") as f:
            return f.readlines()

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log_lines()[-lines:])

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
