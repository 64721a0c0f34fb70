"""Which path a lab takes: a real engine on a CUDA GPU, or the CPU path (DESIGN: two paths).

Detection asks ``nvidia-smi`` for GPUs and looks for the engines' Python packages without
importing them (importing vLLM can take seconds and grab a GPU).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from dataclasses import dataclass

#: The real engines a lab can run, by the name used across labkit (``labkit.launch``), each
#: with the Python package that provides it.
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}


@dataclass(frozen=True)
class LabPath:
    """What this machine offers a lab: GPUs by name and the engines installed (by name)."""

    gpus: tuple[str, ...]
    engines: tuple[str, ...]

    def uses(self, engine: str) -> bool:
        """True when a lab about ``engine`` should take its GPU path here."""
        return bool(self.gpus) and engine in self.engines

    def banner(self, engine: str | None = None) -> str:
        """One line for the top of a lab saying which path runs and why."""
        gpus = ", ".join(self.gpus) if self.gpus else "no CUDA GPU"
        if engine is None:
            return f"CPU path: this lab computes everything on the CPU ({gpus} found)."
        if self.uses(engine):
            return f"GPU path: {engine} on {gpus}."
        missing = ("no CUDA GPU" if not self.gpus
                   else f"{ENGINE_PACKAGES.get(engine, engine)} is not installed")
        return f"CPU path: labkit's teaching engine stands in for {engine} ({missing})."


def detect() -> LabPath:
    """Look at this machine once: GPUs from ``nvidia-smi``, engines from installed packages."""
    return LabPath(gpus=_cuda_gpus(), engines=tuple(
        name for name, package in ENGINE_PACKAGES.items()
        if importlib.util.find_spec(package) is not None))


def _cuda_gpus() -> tuple[str, ...]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())
