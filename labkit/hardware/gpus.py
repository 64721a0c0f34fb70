"""The GPU table of :ref:`ch01-three-numbers`: datasheet numbers, one row per part, each
with its source.

Throughput columns are dense tensor-core peaks (no 2:4 sparsity), the numbers a serving
engine can reach at best. A blank cell means the part has no such tensor path (the A100 has
no FP8). Memory is the datasheet capacity: HBM and GDDR come in binary-sized chips, so the
"80 GB" of an H100 is 80 GiB, of which the driver keeps a few hundred MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.checks import ParameterError
from labkit.data import read_csv
from labkit.units import GiB


@dataclass(frozen=True)
class GPU:
    """One accelerator's datasheet numbers (:ref:`ch01-three-numbers`).

    Units are in the names: ``memory_gib`` (2**30 bytes), ``mem_bandwidth_gb_s`` (10**9 B/s),
    ``*_tflops`` / ``int8_tops`` (10**12 ops/s, dense), ``interconnect_gb_s`` (10**9 B/s,
    total of both directions as marketed), ``tdp_w`` (watts).
    """

    name: str
    vendor: str
    architecture: str
    memory_gib: float
    memory_type: str
    mem_bandwidth_gb_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    int8_tops: float | None
    interconnect: str
    interconnect_gb_s: float
    tdp_w: float
    notes: str
    source: str
    as_of: str

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def mem_bandwidth_bytes_s(self) -> float:
        return self.mem_bandwidth_gb_s * 1e9

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None

    @property
    def consumer(self) -> bool:
        """A GeForce card (its row's notes say so): built for desktops, joined to others over
        PCIe (the RTX 3090's bridge aside), and not sold for data centers
        (:ref:`ch01-decision-tree`)."""
        return self.notes.startswith("GeForce")

    @property
    def has_nvlink(self) -> bool:
        """True when GPUs talk over a dedicated fabric (NVLink, Infinity Fabric), not PCIe."""
        return not self.interconnect.startswith("PCIe")

    def peak_ops_s(self, compute_dtype: str) -> float:
        """Dense tensor-core peak in operations per second for a matmul input dtype.

        ``compute_dtype`` is ``"bf16"``/``"fp16"``, ``"fp8"`` or ``"int8"``.
        """
        table = {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops,
                 "fp8": self.fp8_tflops, "int8": self.int8_tops}
        if compute_dtype not in table:
            raise ParameterError("compute_dtype", f"compute_dtype must be one of "
                                                  f"{sorted(table)}, got {compute_dtype!r}")
        peak = table[compute_dtype]
        if peak is None:
            raise ParameterError("compute_dtype", f"compute_dtype: {self.name} has no "
                                                  f"{compute_dtype} tensor cores")
        return peak * 1e12

    def ridge_point(self, compute_dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns compute-bound
        (:ref:`ch01-three-numbers`)."""
        return self.peak_ops_s(compute_dtype) / self.mem_bandwidth_bytes_s


def _optional(cell: str) -> float | None:
    return float(cell) if cell.strip() else None


@lru_cache(maxsize=1)
def _load() -> dict[str, GPU]:
    table: dict[str, GPU] = {}
    for row in read_csv("gpus.csv"):
        table[row["name"]] = GPU(
            name=row["name"], vendor=row["vendor"], architecture=row["architecture"],
            memory_gib=float(row["memory_gib"]), memory_type=row["memory_type"],
            mem_bandwidth_gb_s=float(row["mem_bandwidth_gb_s"]),
            bf16_tflops=float(row["bf16_tflops"]), fp8_tflops=_optional(row["fp8_tflops"]),
            int8_tops=_optional(row["int8_tops"]), interconnect=row["interconnect"],
            interconnect_gb_s=float(row["interconnect_gb_s"]), tdp_w=float(row["tdp_w"]),
            notes=row["notes"], source=row["source"], as_of=row["as_of"],
        )
    return table


def list_gpus() -> list[GPU]:
    """All GPUs of the table, in table order (:ref:`ch01-three-numbers`)."""
    return list(_load().values())


def get_gpu(name: str | GPU) -> GPU:
    """Look a GPU up by its table name, case and spaces ignored: ``"H100 SXM"``
    (:ref:`ch01-three-numbers`)."""
    if isinstance(name, GPU):
        return name
    key = _normalise(name)
    for gpu in _load().values():
        if _normalise(gpu.name) == key:
            return gpu
    raise ParameterError("gpu", f"gpu: unknown GPU {name!r}; known: {', '.join(_load())}")


def _normalise(name: str) -> str:
    return "".join(name.lower().split()).replace("-", "")


def gpu_table_markdown(gpus: list[GPU] | None = None) -> str:
    """The comparison table of :ref:`ch01-three-numbers` as Markdown, generated from the data file.

    Throughput columns are dense TFLOP/s (INT8: TOP/s); the last column is the BF16 ridge point.
    """
    gpus = gpus if gpus is not None else list_gpus()

    def num(x: float | None) -> str:
        return "—" if x is None else f"{x:,.0f}"

    lines = [
        "| GPU | memory | GB/s | BF16 | FP8 | INT8 | link (GB/s) | TDP (W) | FLOP/byte |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for g in gpus:
        lines.append(
            f"| {g.name} | {g.memory_gib:g} GiB {g.memory_type} | {g.mem_bandwidth_gb_s:,.0f} "
            f"| {num(g.bf16_tflops)} | {num(g.fp8_tflops)} | {num(g.int8_tops)} "
            f"| {g.interconnect} ({g.interconnect_gb_s:,.0f}) | {g.tdp_w:.0f} "
            f"| {g.ridge_point('bf16'):.0f} |"
        )
    return "\n".join(lines)
