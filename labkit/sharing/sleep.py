"""vLLM's sleep mode (chapter 6, :doc:`/chapters/ch06_gpu_sharing`): one model awake at a time,
and what a switch between two models costs.

``POST /sleep?level=1`` copies the sleeping model's weights to host memory and frees its KV
cache; level 2 discards the weights too. :func:`switch_cost` prices a switch over the host link
(``labkit/data/host_links.csv``) or, at level 2, the storage the weights reload from.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError, in_range
from labkit.data import read_csv


@dataclass(frozen=True)
class HostLink:
    """The link between host memory and the GPU (``labkit/data/host_links.csv``)."""

    link: str
    gb_s_per_direction: float
    gb_s_both_directions: float
    gpus: str
    source: str
    as_of: str


def host_links() -> dict[str, HostLink]:
    """The host links by name, each with its bandwidth, source and date."""
    return {r["link"]: HostLink(r["link"], float(r["gb_s_per_direction"]),
                                float(r["gb_s_both_directions"]), r["gpus"], r["source"],
                                r["as_of"]) for r in read_csv("host_links.csv")}


def host_link(name: str) -> HostLink:
    """One host link by name (``"PCIe Gen5 x16"``); an error naming the known ones otherwise."""
    links = host_links()
    if name not in links:
        raise ParameterError("link", f"link must be one of {sorted(links)}, got {name!r}")
    return links[name]


@dataclass(frozen=True)
class SwitchCost:
    """Seconds to put one model to sleep and wake another (chapter 6), at a link's peak:
    lower bounds. The KV cache is discarded at both levels, so the first requests after a
    wake prefill in full (no prefix cache)."""

    level: int
    sleep_s: float
    wake_s: float
    host_memory_bytes: float  # what level 1 keeps in host RAM while asleep

    @property
    def switch_s(self) -> float:
        return self.sleep_s + self.wake_s


def switch_cost(sleeping_weights_bytes: float, waking_weights_bytes: float, level: int,
                link: str = "PCIe Gen5 x16", storage_gb_s: float | None = None) -> SwitchCost:
    """Sleep one model and wake another with vLLM's sleep mode (chapter 6).

    Level 1 copies the sleeping model's weights to host memory and the waking model's back
    (bytes / the link's bandwidth per direction). Level 2 discards the weights: falling asleep
    costs nothing to copy, but waking must reload them (``reload_weights``) from storage at
    ``storage_gb_s``, which you must give (it depends on your disks and page cache).
    """
    in_range("sleeping_weights_bytes", sleeping_weights_bytes, 0)
    in_range("waking_weights_bytes", waking_weights_bytes, 0)
    bandwidth = host_link(link).gb_s_per_direction * 1e9
    if level == 1:
        return SwitchCost(1, sleeping_weights_bytes / bandwidth,
                          waking_weights_bytes / bandwidth, sleeping_weights_bytes)
    if level == 2:
        if storage_gb_s is None:
            raise ParameterError("storage_gb_s", "storage_gb_s: level 2 reloads the weights "
                                                 "from storage; give its read bandwidth in GB/s")
        in_range("storage_gb_s", storage_gb_s, 0, low_open=True)
        return SwitchCost(2, 0.0, waking_weights_bytes / (storage_gb_s * 1e9), 0.0)
    raise ParameterError("level", f"level must be 1 or 2, got {level!r}")

