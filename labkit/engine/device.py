"""A simulated GPU that several processes share: its memory as a ledger on disk
(:ref:`ch06-sharing-two-instances`).

A real GPU's memory is one pool for every process that opens the device: what one server
holds, the next one sees as used (``cudaMemGetInfo``). The teaching engine has no GPU, so
:class:`SimulatedDevice` keeps that pool as a small JSON ledger, one file per device id, that
every ``labkit serve`` started with the same ``--device-id`` reads and writes under a file lock
(``fcntl.flock``). Each process's allocations are tagged (``weights``, ``kv_cache``,
``activations``), as vLLM's sleep-mode allocator tags its pools, so sleep can hand back some and
keep others.

A process that dies without cleaning up, even by SIGKILL, frees its memory as the driver
frees a dead process's: every read sweeps out the entries of processes that no longer exist
(or are zombies, or whose pid now belongs to a newer process).

The startup check of :meth:`SimulatedDevice.request_memory` is vLLM's: an engine asks for
``gpu_memory_utilization`` of the *whole* device and refuses to start when less than that is
free, with vLLM's message (``request_memory`` in ``vllm/v1/worker/utils.py``, called from
``Worker.init_device`` in ``vllm/v1/worker/gpu_worker.py``, vLLM 0.32).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import math
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from labkit.checks import ParameterError, in_range
from labkit.units import GiB

#: Where ledgers live unless ``LABKIT_DEVICE_DIR`` says otherwise.
DEVICE_DIR_ENV = "LABKIT_DEVICE_DIR"
#: The device a ``labkit serve`` shares when ``--device-id`` is not given.
DEVICE_ID_ENV = "LABKIT_DEVICE_ID"


class DeviceMemoryError(ParameterError):
    """An engine cannot have the memory it asks for (a ``ValueError``, as vLLM raises)."""


class DeviceOutOfMemory(RuntimeError):
    """An allocation larger than what is free: the simulated ``CUDA out of memory``."""


def format_gib(num_bytes: float) -> str:
    """vLLM's ``format_gib`` (``vllm/utils/mem_utils.py``): GiB rounded to two decimals."""
    return f"{round(num_bytes / GiB, 2)}"


@dataclass(frozen=True)
class MemorySnapshot:
    """What ``cudaMemGetInfo`` would say: free and total bytes of the device."""

    free_bytes: int
    total_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes


def startup_refusal(device: str, snapshot: MemorySnapshot, gpu_memory_utilization: float,
                    requested_bytes: int) -> str:
    """vLLM 0.32's message when an engine starts with less free memory than it asks for
    (``request_memory``, ``vllm/v1/worker/utils.py``), word for word."""
    return (f"Free memory on device {device} "
            f"({format_gib(snapshot.free_bytes)}/{format_gib(snapshot.total_bytes)} GiB) "
            f"on startup is less than desired GPU memory utilization "
            f"({gpu_memory_utilization}, {format_gib(requested_bytes)} GiB). Decrease GPU "
            f"memory utilization or reduce GPU memory used by other processes.")


@dataclass(frozen=True)
class Holder:
    """One process's entry in the ledger: its allocations by tag, in bytes."""

    holder_id: str
    pid: int
    label: str
    allocations: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.allocations.values())


def default_device_dir() -> Path:
    return Path(os.environ.get(DEVICE_DIR_ENV) or Path(tempfile.gettempdir()) / "labkit-devices")


class SimulatedDevice:
    """A device of ``total_bytes`` shared through the ledger ``<directory>/<device_id>.json``.

    The first process to open a device fixes its size; a later one that names another size is
    refused while anybody holds memory on it (a GPU does not change size). Each instance of
    this class is one holder: one engine, with its own entry, released by :meth:`release`,
    at interpreter exit, or by the sweep once its process is gone.
    """

    def __init__(self, device_id: str, total_bytes: int, label: str = "",
                 directory: str | Path | None = None) -> None:
        if not device_id or any(c in device_id for c in "/\\\0") or device_id.startswith("."):
            raise ParameterError("device_id", f"device_id must be a plain name, got "
                                              f"{device_id!r}")
        in_range("total_bytes", total_bytes, 0, low_open=True)
        self.device_id = device_id
        self.total_bytes = int(total_bytes)
        self.label = label or f"pid {os.getpid()}"
        self.directory = Path(directory) if directory is not None else default_device_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{device_id}.json"
        self.holder_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with self._ledger() as ledger:
            if ledger["holders"] and ledger["total_bytes"] != self.total_bytes:
                raise ParameterError(
                    "device_memory_gib",
                    f"device {device_id} has {format_gib(ledger['total_bytes'])} GiB, and "
                    f"processes are using it; this one was given "
                    f"{format_gib(self.total_bytes)} GiB. Give the same size to every process "
                    f"that shares a device.")
            ledger["total_bytes"] = self.total_bytes
        atexit.register(self.release)

    # -- reading ------------------------------------------------------------------------

    def snapshot(self) -> MemorySnapshot:
        """Free and total bytes now, after sweeping out the dead."""
        with self._ledger() as ledger:
            return MemorySnapshot(ledger["total_bytes"] - _used(ledger), ledger["total_bytes"])

    def holders(self) -> list[Holder]:
        """Every live holder, this one included, in the order they first allocated."""
        with self._ledger() as ledger:
            return [Holder(hid, entry["pid"], entry["label"], dict(entry["allocations"]))
                    for hid, entry in ledger["holders"].items()]

    def allocated(self, tag: str | None = None) -> int:
        """Bytes this holder has under ``tag`` (all tags when ``None``)."""
        with self._ledger() as ledger:
            mine = ledger["holders"].get(self.holder_id, {"allocations": {}})["allocations"]
            return sum(mine.values()) if tag is None else mine.get(tag, 0)

    # -- vLLM's startup check -------------------------------------------------------------

    def request_memory(self, gpu_memory_utilization: float) -> int:
        """vLLM's startup check: ``ceil(total * gpu_memory_utilization)`` bytes must be free.

        Returns the requested bytes (the engine's budget). Raises :class:`DeviceMemoryError`
        with vLLM's wording when the device has less free memory than that: the fraction is
        of the *whole* device, so what other processes hold counts against it.
        """
        in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
        snapshot = self.snapshot()
        requested = math.ceil(snapshot.total_bytes * gpu_memory_utilization)
        if snapshot.free_bytes < requested:
            raise DeviceMemoryError("gpu_memory_utilization", startup_refusal(
                self.device_id, snapshot, gpu_memory_utilization, requested))
        return requested

    # -- allocating -----------------------------------------------------------------------

    def allocate(self, tag: str, num_bytes: int) -> None:
        """Take ``num_bytes`` more under ``tag``, or raise :class:`DeviceOutOfMemory` (and
        take nothing) when the device has less free."""
        if num_bytes < 0:
            raise ParameterError("num_bytes", f"num_bytes must be >= 0, got {num_bytes}")
        with self._ledger() as ledger:
            free = ledger["total_bytes"] - _used(ledger)
            if num_bytes > free:
                raise DeviceOutOfMemory(
                    f"out of memory on device {self.device_id}: tried to allocate "
                    f"{format_gib(num_bytes)} GiB ({tag}); the device has a total capacity of "
                    f"{format_gib(ledger['total_bytes'])} GiB, of which "
                    f"{format_gib(free)} GiB is free")
            entry = ledger["holders"].setdefault(self.holder_id, {
                "pid": os.getpid(), "start_time": _start_time(os.getpid()),
                "label": self.label, "allocations": {}})
            entry["allocations"][tag] = entry["allocations"].get(tag, 0) + int(num_bytes)

    def free(self, tag: str) -> int:
        """Give back everything under ``tag``; returns the bytes freed."""
        with self._ledger() as ledger:
            entry = ledger["holders"].get(self.holder_id)
            if entry is None:
                return 0
            freed = entry["allocations"].pop(tag, 0)
            if not entry["allocations"]:
                del ledger["holders"][self.holder_id]
            return freed

    def release(self) -> None:
        """Give back everything this holder has (engine shutdown, interpreter exit)."""
        if not self.path.exists():
            return
        with self._ledger() as ledger:
            ledger["holders"].pop(self.holder_id, None)

    # -- the ledger file --------------------------------------------------------------------

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[dict]:
        """The ledger, locked for this block, swept of dead holders, written back after."""
        with open(self.directory / f"{self.device_id}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    ledger = json.loads(self.path.read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    ledger = {"device_id": self.device_id, "total_bytes": self.total_bytes,
                              "holders": {}}
                ledger["holders"] = {hid: e for hid, e in ledger["holders"].items()
                                     if _alive(e["pid"], e.get("start_time"))}
                yield ledger
                # Write whole and rename: a reader never sees half a file.
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(ledger, indent=1))
                tmp.replace(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _used(ledger: dict) -> int:
    return sum(sum(e["allocations"].values()) for e in ledger["holders"].values())


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``, field 22):
    with the pid, it names one process even after the pid is reused. ``None`` off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # fields[0] is field 3 (the state), so field 22 is fields[19]


def _alive(pid: int, start_time: int | None) -> bool:
    """Whether the process that made an entry still runs: it exists, is not a zombie (killed
    but not yet reaped) and, where ``/proc`` tells, started when the entry says it did."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # somebody else's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): existing is all we can tell
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return False
    return start_time is None or int(fields[19]) == start_time
