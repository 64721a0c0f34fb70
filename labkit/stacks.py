"""The heavy reference stacks, installed on first use, so ``make lab`` stays light.

Two labs' worth of packages weigh more than everything else a student installs, and only one
lab needs them: :func:`ensure` installs a stack the first time a lab asks for it, and does
nothing (two cheap file-system checks) every time after.

* ``"ref"``: CPU torch, transformers and llm-compressor, the ``ref`` extra of labkit's
  ``pyproject.toml``, installed into the running kernel's own environment. The requirement
  specs are read from labkit's installed metadata, so ``pyproject.toml`` stays their one source.
* ``"awq"``: AutoAWQ, deprecated upstream and pinned to ``transformers<4.52``, in an
  environment of its own, ``.venv-awq`` in the checkout (where
  :func:`labkit.quant.tools.autoawq_python` looks); ``make awq-env`` and ``make test`` build it
  through this module too.

``python -m labkit.stacks NAME`` installs a stack ahead of time (the doctor names it).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.checks import ParameterError


@dataclass(frozen=True)
class Stack:
    """What a stack brings and why a student waits for it (the one line printed before it
    installs); ``size_mb`` is its footprint on disk, in MB."""

    what: str
    size_mb: int
    why: str


# Sizes measured with `du -sm` on Linux x86-64, CPU build of torch 2.13.0: a fresh `.[lab]`
# venv before and after `ensure("ref")` (707 -> 1987 MB), and a finished .venv-awq (2423 MB,
# 1 GB of it the triton wheel torch pulls there).
STACKS = {
    "ref": Stack("CPU torch, transformers and llm-compressor", 1300,
                 "04_quantization_tools quantizes the tiny model with llm-compressor"),
    "awq": Stack("AutoAWQ with its own torch and transformers<4.52", 2400,
                 "04_quantization_tools compares the tutorial's AutoAWQ, which needs an older "
                 "transformers than the course, hence an environment of its own"),
}

#: The modules whose presence means the ``ref`` stack is installed (``find_spec``, no import).
REF_MODULES = ("torch", "transformers", "llmcompressor")

#: AutoAWQ's environment: the CPU torch of the course, the last transformers AutoAWQ imports
#: with, and AutoAWQ's last release.
AWQ_REQUIREMENTS = ("torch==2.13.0", "transformers<4.52", "autoawq==0.2.9")
AWQ_VENV = ".venv-awq"
AWQ_PYTHON_ENV = "LABKIT_AUTOAWQ_PYTHON"  # labkit.quant.tools runs AutoAWQ with this, if set

# No progress bars (they are thousands of carriage returns once captured) or version nags.
PIP_INSTALL = ("-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check")

#: Downloads at least this large (MB) get a progress line; smaller ones pass silently.
SHOW_DOWNLOAD_MB = 20.0
#: pip's "Downloading torch-2.13.0+cpu-cp311-...whl (190.3 MB)" (a file name, or a URL).
DOWNLOAD = re.compile(r"\s*Downloading (?:\S*/)?(\S+?)-([^-\s]+)-\S* \(([\d.]+) ([kMG]B)\)")
#: uv's "Downloading torch (190.3MiB)" and "Installed 45 packages in 1.2s".
UV_DOWNLOAD = re.compile(r"\s*Downloading (\S+) \(([\d.]+)([KMG]iB)\)")
UV_INSTALLED = re.compile(r"Installed (\d+) packages? in ")
UNIT_MB = {"kB": 1e-3, "MB": 1.0, "GB": 1e3, "KiB": 2**10 / 1e6, "MiB": 2**20 / 1e6,
           "GiB": 2**30 / 1e6}


class StackInstallError(RuntimeError):
    """pip (or venv) failed while installing a stack; the message names the command to rerun."""


def _check_name(name: str) -> Stack:
    if name not in STACKS:
        raise ParameterError("name", f"name must be one of {', '.join(map(repr, STACKS))}, "
                                     f"got {name!r}")
    return STACKS[name]


def requirements(name: str) -> list[str]:
    """The requirement specs a stack installs: for ``ref``, the ``ref`` extra of labkit's
    installed metadata (what ``pip install -e .`` recorded from ``pyproject.toml``)."""
    _check_name(name)
    if name == "awq":
        return list(AWQ_REQUIREMENTS)
    from packaging.requirements import Requirement  # matplotlib's dependency: always there

    specs = []
    for line in importlib.metadata.requires("labkit") or []:
        req = Requirement(line)
        # In the extra and only there: base dependencies have no marker, or one true without it.
        if req.marker and req.marker.evaluate({"extra": "ref"}) \
                and not req.marker.evaluate({"extra": ""}):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            specs.append(f"{req.name}{extras}{req.specifier}")
    return specs


def awq_venv() -> Path:
    """Where ``.venv-awq`` goes: the checkout's root, where
    :func:`labkit.quant.tools.autoawq_python` looks for it."""
    return Path(__file__).resolve().parents[1] / AWQ_VENV


def present(name: str, venv: Path | None = None) -> bool:
    """Whether a stack is installed, from cheap checks only: ``ref``'s modules are findable
    by this interpreter; ``awq``'s environment has the stamp written when its install
    finished (an interrupted install leaves none), or ``$LABKIT_AUTOAWQ_PYTHON`` names an
    interpreter that exists."""
    _check_name(name)
    if name == "ref":
        return all(importlib.util.find_spec(module) is not None for module in REF_MODULES)
    given = os.environ.get(AWQ_PYTHON_ENV)
    if venv is None and given:
        return Path(given).is_file()
    return ((venv or awq_venv()) / ".installed").is_file()


def uv_beside(python: str | os.PathLike) -> Path | None:
    """uv, where it sits beside ``python`` (``make`` installs it into ``.venv``), else None.

    uv installs these stacks in seconds where pip takes minutes (it unpacks in parallel and
    hard-links what it unpacked before); without it, pip does the same job."""
    uv = Path(python).parent / "uv"
    return uv if uv.is_file() and os.access(uv, os.X_OK) else None


def uv_options() -> list[str]:
    """What uv needs to do what pip would do: no pre-release (uv's default, and even its
    ``if-necessary``, takes llm-compressor's nightly alpha for the course), byte-code compiled
    at install (where ``PYTHONDONTWRITEBYTECODE`` is set, nothing would ever cache it), and
    the wheel folders ``$PIP_FIND_LINKS`` names (where a machine keeps its CPU torch), since uv
    reads no pip configuration; ``$UV_FIND_LINKS``, where set, is uv's own and wins."""
    links = [] if os.environ.get("UV_FIND_LINKS") else os.environ.get("PIP_FIND_LINKS", "").split()
    return ["--prerelease", "disallow", "--compile-bytecode",
            *(arg for link in links for arg in ("--find-links", link))]


def commands(name: str, python: str | os.PathLike = sys.executable,
             venv: Path | None = None) -> list[list[str]]:
    """The commands that install a stack, in order: the ``ref`` extra into ``python``'s
    environment; for ``awq``, a new environment ``venv`` made from ``python``, then AutoAWQ's
    pins inside it. By uv where it sits beside ``python`` (:func:`uv_beside`), else by
    ``python -m venv`` and pip."""
    specs = requirements(name)
    venv = venv or awq_venv()
    target = python if name == "ref" else venv / "bin" / "python"
    if uv := uv_beside(python):
        install_specs = [str(uv), "pip", "install", *uv_options(), "--python", str(target),
                         *specs]
        make_venv = [str(uv), "venv", "--allow-existing", "--python", str(python), str(venv)]
    else:
        install_specs = [str(target), *PIP_INSTALL, *specs]
        make_venv = [str(python), "-m", "venv", str(venv)]
    return [install_specs] if name == "ref" else [make_venv, install_specs]


def _packages(count: int) -> str:
    return f"{count} package{'' if count == 1 else 's'}"


def condense(line: str) -> str | None:
    """The progress line worth showing for one line of pip's or uv's output, else ``None``:
    large downloads, the install step and its end (pip prints hundreds of lines for torch)."""
    if found := DOWNLOAD.match(line):
        package, version, size, unit = found.groups()
        return f"  downloading {package} {version} ({size} {unit})" \
            if float(size) * UNIT_MB[unit] >= SHOW_DOWNLOAD_MB else None
    if found := UV_DOWNLOAD.match(line):
        package, size, unit = found.groups()
        return f"  downloading {package} ({size} {unit})" \
            if float(size) * UNIT_MB[unit] >= SHOW_DOWNLOAD_MB else None
    if line.startswith("Installing collected packages:"):
        return f"  installing {_packages(len(line.split(':', 1)[1].split(',')))}"
    if line.startswith("Successfully installed"):
        return f"  installed {_packages(len(line.split()) - 2)}"
    if found := UV_INSTALLED.match(line):
        return f"  installed {_packages(int(found.group(1)))}"
    return None


def _run(command: list[str], name: str) -> None:
    """Run one install command, printing only :func:`condense`'s lines; on failure raise
    :class:`StackInstallError` with pip's last lines and the command to run by hand."""
    tail: collections.deque[str] = collections.deque(maxlen=12)
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as process:
            for line in process.stdout:
                tail.append(line.rstrip())
                if (shown := condense(line)) is not None:
                    print(shown, flush=True)
        status = process.returncode
    except OSError as error:  # the interpreter itself is missing or not executable
        tail.append(str(error))
        status = None
    if status != 0:
        failed = "could not start" if status is None else f"exit status {status}"
        last = "\n".join(f"    {line}" for line in tail)
        retry = shlex.join([sys.executable, "-m", "labkit.stacks", name])
        raise StackInstallError(
            f"installing the {name} stack failed ({failed}); its last lines:\n{last}\n"
            f"Check the internet connection and the free disk space, then run by hand:\n"
            f"    {shlex.join(command)}\n"
            f"or every step of it at once: {retry}")


def install(name: str, python: str | os.PathLike = sys.executable,
            venv: Path | None = None) -> None:
    """Install a stack now, whether or not it is present (:func:`ensure` checks first)."""
    stack = _check_name(name)
    where = Path(python).parents[1] if name == "ref" else venv or awq_venv()
    print(f"labkit: installing the {name} stack ({stack.what}; ~{stack.size_mb} MB, once per "
          f"machine, under a minute with uv, a few with pip) into {where}: {stack.why}.",
          flush=True)
    for command in commands(name, python, venv):
        _run(command, name)
    if name == "awq":
        (venv or awq_venv()).joinpath(".installed").touch()
        return
    # New top-level packages in site-packages are importable once the finders forget what
    # they listed; modules imported before the install, or a site dir added since, need a
    # fresh interpreter.
    importlib.invalidate_caches()
    stale = [m for m in REF_MODULES if m in sys.modules or importlib.util.find_spec(m) is None]
    print(f"  ready: restart the kernel (Kernel > Restart Kernel) to import {', '.join(stale)}"
          if stale else "  ready: importable in this kernel", flush=True)


def ensure(name: str, python: str | os.PathLike = sys.executable,
           venv: Path | None = None) -> bool:
    """Install a stack unless it is present; True when it installed something.

    ``python`` is the interpreter that runs the install (``ref``: the environment that
    receives it; ``awq``: the one that creates ``venv``), by default this kernel's; ``venv`` is
    where ``awq`` goes (default :func:`awq_venv`). Raises :class:`StackInstallError` naming the
    command to run by hand when pip fails, and ``ParameterError`` for an unknown ``name``.
    """
    if present(name, venv):
        return False
    if name == "awq" and venv is None and os.environ.get(AWQ_PYTHON_ENV):
        # An environment the instructor built: never install over it, say what is wrong.
        raise StackInstallError(f"${AWQ_PYTHON_ENV} is {os.environ[AWQ_PYTHON_ENV]}, which "
                                f"does not exist: fix it, or unset it to let labkit build "
                                f"{awq_venv()}")
    install(name, python, venv)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.stacks NAME [--venv DIR]``: install a stack ahead of first use."""
    parser = argparse.ArgumentParser(prog="python -m labkit.stacks", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("name", help=f"the stack: {', '.join(STACKS)}")
    parser.add_argument("--venv", type=Path, default=None,
                        help=f"where the awq environment goes (default: {awq_venv()})")
    args = parser.parse_args(argv)
    try:
        if not ensure(args.name, venv=args.venv):
            print(f"labkit: the {args.name} stack is already installed")
    except (ParameterError, StackInstallError) as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
