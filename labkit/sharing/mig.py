"""Partitioning one GPU (:ref:`ch06-sharing-mig`, :ref:`ch06-sharing-timeslicing-mps`): MIG
profiles and their placement rules, and how MIG compares with time-slicing and MPS.

MIG cuts an A100, H100, H200 or B200 into isolated instances: :func:`pack_mig` says whether a set of
profiles fits one GPU, with the placement rules of NVIDIA's MIG user guide, and
:func:`smallest_mig_profile` which profile an instance needs. :func:`sharing_mechanisms` sets the
three mechanisms side by side, each row with its source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from labkit.checks import ParameterError, in_range
from labkit.data import read_csv
from labkit.hardware import GPU, get_gpu, list_gpus

#: Memory slices of every MIG-capable GPU here ("roughly one eighth of the total GPU memory",
#: MIG user guide, Concepts), and the compute (SM) slices ("one seventh").
MIG_MEMORY_SLICES = 8
MIG_COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfile:
    """A GPU instance profile (``labkit/data/mig_profiles.csv``, from NVIDIA's MIG user
    guide): its slices and the memory slices it may start at (``nvidia-smi mig -lgipp``)."""

    gpu: str
    name: str
    profile_id: int
    compute_slices: int
    memory_slices: int
    start_slots: tuple[int, ...]
    max_instances: int
    notes: str
    source: str
    as_of: str

    @property
    def memory_gib(self) -> float:
        """Its share of the GPU's memory; ``nvidia-smi`` reports a little less per instance
        (the guide's A100-40GB example shows 20096 and 20224 MiB for two 3g.20gb)."""
        return get_gpu(self.gpu).memory_gib * self.memory_slices / MIG_MEMORY_SLICES


@lru_cache(maxsize=1)
def _mig_table() -> tuple[MigProfile, ...]:
    return tuple(MigProfile(
        gpu=r["gpu"], name=r["profile"], profile_id=int(r["profile_id"]),
        compute_slices=int(r["compute_slices"]), memory_slices=int(r["memory_slices"]),
        start_slots=tuple(int(s) for s in r["start_slots"].split()),
        max_instances=int(r["max_instances"]), notes=r["notes"], source=r["source"],
        as_of=r["as_of"]) for r in read_csv("mig_profiles.csv"))


def mig_gpus() -> list[str]:
    """The GPUs of chapter 1's table that ``mig_profiles.csv`` can cut, in table order."""
    have = {p.gpu for p in _mig_table()}
    return [g.name for g in list_gpus() if g.name in have]


def mig_profiles(gpu: GPU | str) -> list[MigProfile]:
    """The MIG profiles of ``gpu``, smallest first; an error for a GPU without MIG here."""
    name = get_gpu(gpu).name
    profiles = [p for p in _mig_table() if p.gpu == name]
    if not profiles:
        raise ParameterError("gpu", f"gpu: no MIG profiles for {name}; known: "
                                    f"{', '.join(mig_gpus())}")
    return profiles


def mig_profile(gpu: GPU | str, name: str) -> MigProfile:
    """One profile by its name (``"3g.40gb"``) on ``gpu``."""
    profiles = mig_profiles(gpu)
    for profile in profiles:
        if profile.name == name:
            return profile
    raise ParameterError("profiles", f"profiles: {name!r} is not a MIG profile of "
                                     f"{get_gpu(gpu).name}; its profiles are "
                                     f"{', '.join(p.name for p in profiles)}")


@dataclass(frozen=True)
class MigLayout:
    """Profiles placed on one GPU: ``placements[i]`` is ``(profile, first memory slice)``."""

    gpu: str
    placements: tuple[tuple[MigProfile, int], ...]
    existing: tuple[tuple[MigProfile, int], ...] = ()  # instances that were there already

    def create_command(self) -> str:
        """``nvidia-smi mig -cgi`` for the new instances, largest profile first: nvidia-smi
        chooses each placement itself, and the guide's example shows 3g.20gb failing with
        "Insufficient Resources" when created after 1g, 1g and 2g (profile 9 "must be
        specified first")."""
        new = [p for p in self.placements if p not in self.existing]
        ordered = sorted(new, key=lambda p: (-p[0].memory_slices, p[1]))
        return "nvidia-smi mig -cgi " + ",".join(str(p.profile_id) for p, _ in ordered) + " -C"

    def diagram(self) -> str:
        """The eight memory slices, each labelled with the profile that holds it."""
        cells = ["free"] * MIG_MEMORY_SLICES
        for profile, start in self.placements:
            for s in range(start, start + profile.memory_slices):
                cells[s] = profile.name
        return " | ".join(f"{i}:{c}" for i, c in enumerate(cells))


@dataclass(frozen=True)
class MigFit:
    """The answer of :func:`pack_mig`: a layout, or why there is none."""

    layout: MigLayout | None
    reason: str

    def __bool__(self) -> bool:
        return self.layout is not None


def pack_mig(gpu: GPU | str, names: Sequence[str],
             existing: Sequence[tuple[str, int]] = ()) -> MigFit:
    """Whether these MIG profiles fit one GPU together, and where (:ref:`ch06-sharing-mig`).

    The rules of NVIDIA's MIG user guide: at most 7 compute slices and 8 memory slices;
    each profile at most its "Number of Instances Available"; and each instance starts at one
    of its profile's placements, its memory slices overlapping no other instance's (NVML: a
    new GPU instance "will fail if there is overlap with the already occupied memory
    slices"). ``existing`` lists instances already on the GPU as ``(profile, start slot)``:
    they stay where they are, which is how a GPU fragments as instances come and go.
    Placements are searched exhaustively, largest profile first.
    """
    gpu = get_gpu(gpu)
    if not names:
        raise ParameterError("profiles", "profiles must name at least one MIG profile")
    fixed = [(mig_profile(gpu, n), start) for n, start in existing]
    taken = [False] * MIG_MEMORY_SLICES
    for profile, start in fixed:
        span = range(start, start + profile.memory_slices)
        if start not in profile.start_slots or any(taken[s] for s in span):
            raise ParameterError("existing", f"existing: {profile.name} cannot be at slot "
                                             f"{start} ({_slots(profile)}, not overlapping)")
        for s in span:
            taken[s] = True
    profiles = sorted((mig_profile(gpu, n) for n in names),
                      key=lambda p: (-p.memory_slices, -p.compute_slices, p.name))
    everything = profiles + [p for p, _ in fixed]
    compute = sum(p.compute_slices for p in everything)
    memory = sum(p.memory_slices for p in everything)
    listed = " + ".join([*names, *(f"{p.name} (at {s})" for p, s in fixed)])
    if compute > MIG_COMPUTE_SLICES:
        return MigFit(None, f"{listed} need {compute} compute slices; a {gpu.name} has "
                            f"{MIG_COMPUTE_SLICES}")
    if memory > MIG_MEMORY_SLICES:
        return MigFit(None, f"{listed} need {memory} memory slices; a {gpu.name} has "
                            f"{MIG_MEMORY_SLICES}")
    for profile in dict.fromkeys(everything):
        count = sum(p is profile for p in everything)
        if count > profile.max_instances:
            return MigFit(None, f"{count} x {profile.name}: a {gpu.name} allows at most "
                                f"{profile.max_instances}")
    placement = _place(profiles, taken)
    if placement is None:
        held = [s for s in range(MIG_MEMORY_SLICES) if taken[s]]
        return MigFit(None, f"{listed} fit in slices but not in place: with slots {held} "
                            f"taken, no choice of start slots "
                            f"({'; '.join(_slots(p) for p in dict.fromkeys(profiles))}) keeps "
                            f"them from overlapping")
    layout = MigLayout(gpu.name, tuple(sorted([*zip(profiles, placement, strict=True), *fixed],
                                              key=lambda p: p[1])), tuple(fixed))
    return MigFit(layout, f"fits: {layout.diagram()}")


def _slots(profile: MigProfile) -> str:
    return f"{profile.name} at {{{','.join(map(str, profile.start_slots))}}}"


def _place(profiles: Sequence[MigProfile], taken: list[bool]) -> list[int] | None:
    """Start slots for ``profiles`` on the free memory slices, by backtracking."""
    if not profiles:
        return []
    first, rest = profiles[0], profiles[1:]
    for start in first.start_slots:
        span = range(start, start + first.memory_slices)
        if span.stop > MIG_MEMORY_SLICES or any(taken[s] for s in span):
            continue
        for s in span:
            taken[s] = True
        placed = _place(rest, taken)
        for s in span:
            taken[s] = False
        if placed is not None:
            return [start, *placed]
    return None


def smallest_mig_profile(gpu: GPU | str, needed_gib: float,
                         gpu_memory_utilization: float = 0.9) -> MigProfile | None:
    """The smallest profile (memory, then compute) in which an instance that needs
    ``needed_gib`` of budget fits: vLLM inside a MIG instance takes
    ``gpu_memory_utilization`` of *that instance's* memory. ``None`` when none is big enough."""
    in_range("needed_gib", needed_gib, 0, low_open=True)
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    fitting = [p for p in mig_profiles(gpu) if "+me" not in p.name
               and p.memory_gib * gpu_memory_utilization >= needed_gib]
    return min(fitting, key=lambda p: (p.memory_slices, p.compute_slices), default=None)


# -- time-slicing and MPS beside MIG ----------------------------------------------------------

@dataclass(frozen=True)
class SharingMechanism:
    """How one GPU-sharing mechanism isolates its tenants (``labkit/data/gpu_sharing.csv``)."""

    mechanism: str
    partition_type: str
    max_partitions: str
    compute_isolation: str
    memory_limit: str
    memory_bandwidth_qos: str
    fault_isolation: str
    reconfigure: str
    latency_interference: str
    source: str
    as_of: str


def sharing_mechanisms() -> list[SharingMechanism]:
    """Time-slicing, MPS and MIG compared, each row with its source
    (:ref:`ch06-sharing-timeslicing-mps`)."""
    return [SharingMechanism(**row) for row in read_csv("gpu_sharing.csv")]

