"""How long each lab takes to run top to bottom on this machine: the instructor guide's table.

Each lab in :data:`labkit.doctor.LABS` runs on its own under nbval, in a fresh kernel, exactly
as ``make test`` runs it (pytest's configured ``--nbval`` with ``labs/sanitize.cfg``), with
``--durations=5`` so the log shows which cells take the time. The wall-clock seconds of that run
(kernel start included: what a student waits for after "Run all") go to
``book/data/lab_times.csv`` with the path the lab took here (:func:`labkit.lab.detect`), the
machine and the date. The instructor guide renders that file when the book builds.

Measure on the machine you will teach on, with nothing else running: a 2-core laptop's timings
move by tens of percent with whatever else is busy. A lab that fails is written with an empty
``seconds`` and reported, never timed.

    python benchmarks/lab_times.py [--labs 01_gpu_memory 05_gateway] [--out book/data/lab_times.csv]

Or read the times of a whole ``make test`` run instead of running the labs again: run it with
``PYTEST_ADDOPTS=--junitxml=run.xml`` and pass ``--from-junit run.xml``; a lab's time is then
the sum of its cells' times (the kernel's start, a few seconds, is not in it).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from labkit.doctor import LABS
from labkit.lab import LabPath, detect

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("lab", "seconds", "path", "machine", "measured_on", "command")


def lab_path(lab: str, here: LabPath) -> str:
    """The path a lab takes here, in the table's words: ``cpu`` for a lab that computes on the
    CPU, else ``gpu``, ``vllm-cpu`` or ``teaching`` for the engine it is about."""
    engine = LABS[lab].engine
    if engine is None:
        return "cpu"
    return {"gpu": "gpu", "cpu": "vllm-cpu", "teaching": "teaching"}[here.runs(engine)]


def machine() -> str:
    """This machine in a few words: cores the process may use, CPU architecture, OS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores {platform.machine()} {platform.system()}"


def time_lab(lab: str) -> tuple[float | None, list[str]]:
    """Run one lab under nbval; its wall-clock seconds (``None`` if it failed) and command."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--durations=5", f"labs/{lab}.ipynb"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT)
    seconds = time.perf_counter() - start
    return (seconds if result.returncode == 0 else None), command


def junit_lab_seconds(junit: Path) -> tuple[dict[str, float], set[str]]:
    """Seconds per lab from a pytest JUnit XML report (the sum of its cells), and the labs
    with a failed or errored cell."""
    seconds: dict[str, float] = defaultdict(float)
    failed: set[str] = set()
    for case in ET.parse(junit).iter("testcase"):
        # pytest names a notebook's cells by its path with dots: labs.gpu.sglang.ipynb
        name = case.get("classname", "")
        if not (name.startswith("labs.") and name.endswith(".ipynb")):
            continue
        lab = name.removeprefix("labs.").removesuffix(".ipynb").replace(".", "/")
        seconds[lab] += float(case.get("time", 0))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(lab)
    return dict(seconds), failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--labs", nargs="*", default=list(LABS), choices=list(LABS),
                        metavar="LAB", help="labs to time (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "book" / "data" / "lab_times.csv")
    parser.add_argument("--from-junit", type=Path, metavar="XML",
                        help="take the times from this JUnit report of a make test run")
    args = parser.parse_args()

    here, today, where = detect(), datetime.date.today().isoformat(), machine()
    if args.from_junit:
        measured, broken = junit_lab_seconds(args.from_junit)
    rows, failed = [], []
    for lab in args.labs:
        if args.from_junit:
            seconds = None if lab in broken else measured.get(lab)
            shown = ["PYTEST_ADDOPTS=--junitxml=run.xml", "make", "test"]
        else:
            seconds, command = time_lab(lab)
            shown = ["python", *command[1:]]  # the command as a reader would type it
        if seconds is None:
            failed.append(lab)
        rows.append({"lab": lab, "seconds": "" if seconds is None else f"{seconds:.0f}",
                     "path": lab_path(lab, here), "machine": where, "measured_on": today,
                     "command": shlex.join(shown)})
        print(f"{lab}: {rows[-1]['seconds'] or 'FAILED'} s ({rows[-1]['path']})", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
