"""``labkit doctor``: a workshop preflight that says what this machine can run, and the fix.

It checks Python, the installed extras, a free loopback port, disk and memory, the GPU, the
engines (DESIGN: three paths), the tools some labs call (Prometheus) and the heavy stacks a lab
installs on first use (``labkit.stacks``), then prints, for each lab, which path it will take
here. Every failed check carries the command that fixes it, so a student can act on the output
without asking; a stack not yet installed is no failure, and its line names the command that
installs it ahead. Nothing here starts an engine or imports one: detection is
:func:`labkit.lab.detect`'s.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from labkit import stacks
from labkit.lab import LabPath, detect
from labkit.process import free_port

@dataclass(frozen=True)
class LabNeeds:
    """What a lab needs beyond the core install: the engine it is about (``None`` for a lab
    that computes on the CPU), the modules it imports with the extra that brings each, the
    optional tools it uses when present (it falls back without them and says so), and the
    ``labkit.stacks`` it installs on first use."""

    engine: str | None = None
    modules: tuple[tuple[str, str], ...] = ()  # (import name, extra)
    optional_tools: tuple[str, ...] = ()
    stacks: tuple[str, ...] = ()


SERVE = (("fastapi", "serve"), ("httpx", "serve"), ("openai", "serve"))
GATEWAY = (*SERVE, ("vllm_router", "gateway"), ("kubernetes_validate", "gateway"))

#: Every lab, by its path under ``labs/``; tests/test_doctor.py checks it against the notebooks.
LABS: dict[str, LabNeeds] = {
    "01_gpu_memory": LabNeeds(),
    "02_offline_inference": LabNeeds("vllm"),
    "02_openai_server": LabNeeds("vllm", SERVE),
    "02_benchmark_serving": LabNeeds("vllm", SERVE),
    "03_paged_kv_cache": LabNeeds(),
    "03_batching": LabNeeds(),
    "03_tensor_parallel": LabNeeds("vllm"),
    "04_quantization_from_scratch": LabNeeds(),
    "04_quantization_tools": LabNeeds("vllm", (("openai", "serve"),), stacks=("ref", "awq")),
    "05_gateway": LabNeeds(modules=GATEWAY),
    "05_autoscaling": LabNeeds(modules=GATEWAY),
    "06_cost": LabNeeds("vllm", SERVE),
    "06_gpu_sharing": LabNeeds(modules=SERVE),
    "07_tco": LabNeeds(),
    "08_deploy": LabNeeds("vllm", GATEWAY),
    "08_monitoring": LabNeeds(modules=GATEWAY, optional_tools=("prometheus",)),
    "09_speculative_decoding": LabNeeds("vllm", SERVE),
    "gpu/vllm_deploy_benchmark": LabNeeds("vllm", SERVE),
    "gpu/sglang": LabNeeds("sglang", SERVE),
    "gpu/tensorrt_llm": LabNeeds("trtllm", SERVE),
}

#: The make target or command that installs each extra the labs import.
EXTRA_FIX = {"serve": "make lab", "gateway": "make lab"}

MIN_PYTHON = (3, 10)
MIN_DISK_GB = 10.0      # the venvs (CPU torch, vLLM's CPU build) and the tiny models
MIN_MEMORY_GB = 4.0     # a vLLM CPU server (its KV cache is 1-2 GiB in the labs) and a kernel


@dataclass(frozen=True)
class Check:
    """One preflight check: its name, whether it passed, what was seen, and the fix."""

    name: str
    ok: bool
    seen: str
    fix: str = ""
    required: bool = True  # a failed optional check only narrows which path a lab takes
    first_use: bool = False  # not there yet, and installs itself when a lab needs it


@dataclass
class Report:
    checks: list[Check]
    path: LabPath
    labs: dict[str, str] = field(default_factory=dict)  # lab -> what runs here

    @property
    def ok(self) -> bool:
        """True when every required check passed (optional ones only change the paths)."""
        return all(c.ok for c in self.checks if c.required)

    def text(self) -> str:
        lines = ["labkit doctor: can this machine run the labs?", ""]
        for c in self.checks:
            mark = ("ok  " if c.ok else "info" if c.first_use
                    else "FAIL" if c.required else "warn")
            lines.append(f"[{mark}] {c.name}: {c.seen}")
            if not c.ok and c.fix:
                lines.append(f"       {'ahead' if c.first_use else 'fix'}: {c.fix}")
        lines += ["", "What each lab runs here:"]
        width = max(map(len, self.labs))
        lines += [f"  {lab:<{width}}  {runs}" for lab, runs in self.labs.items()]
        lines += ["", "ready" if self.ok else "not ready: fix the FAIL lines above"]
        return "\n".join(lines)


def _module_present(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _available_memory_gb() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), in GB; ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def stack_fix(name: str) -> str:
    """The command that installs a stack ahead of its first use."""
    return f"python -m labkit.stacks {name}"


def _stack_present(name: str) -> bool:
    return stacks.present(name)


def lab_runs(needs: LabNeeds, path: LabPath, tools: set[str]) -> str:
    """One line: the path a lab with ``needs`` takes here (the lab prints the same banner);
    ``tools`` are the optional tools this machine has."""
    lacking = sorted({extra for module, extra in needs.modules if not _module_present(module)})
    if lacking:
        return f"cannot run: extras {', '.join(lacking)} missing ({EXTRA_FIX[lacking[0]]})"
    line = path.banner(needs.engine) if needs.engine else "CPU path (computes on the CPU)."
    absent = [tool for tool in needs.optional_tools if tool not in tools]
    if absent:
        line += f" Without {', '.join(absent)}: that part falls back and the lab says so."
    later = [name for name in needs.stacks if not _stack_present(name)]
    if later:
        line += (" Installs on first use: " + ", ".join(
            f"{name} (~{stacks.STACKS[name].size_mb} MB)" for name in later) + ".")
    return line


def run_checks(path: LabPath | None = None, root: Path | None = None) -> Report:
    """Look at this machine and say what each lab will do here (the workshop's preflight)."""
    path = path or detect()
    root = root or Path(sys.prefix).parent
    checks: list[Check] = []

    version = sys.version_info[:2]
    checks.append(Check("python", version >= MIN_PYTHON,
                        f"{sys.version.split()[0]} at {sys.executable}",
                        f"install Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer"))

    for extra, modules in (("serve", SERVE), ("gateway", GATEWAY)):
        absent = [m for m, e in modules if e == extra and not _module_present(m)]
        checks.append(Check(f"extra [{extra}]", not absent,
                            "installed" if not absent else f"missing {', '.join(absent)}",
                            EXTRA_FIX[extra]))
    for name, stack in stacks.STACKS.items():
        there = _stack_present(name)
        checks.append(Check(f"stack {name}", there, "installed" if there else
                            f"not installed: installs on first use (~{stack.size_mb} MB)",
                            stack_fix(name), required=False, first_use=True))

    try:
        port = free_port()
    except OSError:  # no loopback sockets here
        port = None
    checks.append(Check("loopback port", port is not None,
                        f"can listen on 127.0.0.1:{port}" if port else "cannot bind 127.0.0.1",
                        "the labs start servers on 127.0.0.1: allow loopback sockets"))

    disk_gb = shutil.disk_usage(root).free / 1e9
    checks.append(Check("disk", disk_gb >= MIN_DISK_GB, f"{disk_gb:.0f} GB free at {root}",
                        f"free at least {MIN_DISK_GB:.0f} GB (the environments and models)"))

    memory_gb = _available_memory_gb()
    checks.append(Check("memory", memory_gb is None or memory_gb >= MIN_MEMORY_GB,
                        "unknown" if memory_gb is None else f"{memory_gb:.1f} GB available",
                        f"close programs: the engine labs want {MIN_MEMORY_GB:.0f} GB"))

    checks.append(Check("GPU", bool(path.gpus),
                        ", ".join(path.gpus) if path.gpus else "no CUDA GPU (nvidia-smi)",
                        "none needed: the labs take vLLM on CPU or the teaching engine",
                        required=False))
    checks.append(Check("vLLM on CPU", path.vllm_cpu_python is not None,
                        path.vllm_cpu_python or "no .venv-vllm",
                        "make vllm-env (Linux x86-64/aarch64; 3 minutes)", required=False))
    for engine in ("vllm", "sglang", "trtllm"):
        checks.append(Check(f"engine {engine}", engine in path.engines,
                            "installed" if engine in path.engines else "not installed",
                            "GPU machines only; the lab falls back and says so",
                            required=False))
    tools: set[str] = set()
    for tool, fix in (("prometheus", "make prometheus (Debian: apt-get install prometheus)"),
                      ("promtool", "make prometheus")):
        found = shutil.which(tool)
        if found:
            tools.add(tool)
        checks.append(Check(tool, found is not None, found or "not found", fix, required=False))

    labs = {lab: lab_runs(needs, path, tools) for lab, needs in LABS.items()}
    return Report(checks, path, labs)


def main() -> int:
    """``labkit doctor``: print the report; exit status 1 when a required check failed."""
    report = run_checks()
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
