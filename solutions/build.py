"""Instructor copies of the labs with every exercise answered, run and checked: ``make solutions``.

For each lab with graded cells, the copy in ``solutions/_build/`` has each ``NAME = None`` line
replaced by the reference answer of ``solutions/answers.toml`` (the cell is tagged
``solution``). The copy runs top to bottom in a fresh kernel of this Python, in the lab's own
directory, as nbval runs the student's notebook. After each graded cell a cell of its own
(removed again before the copy is saved) asserts that the check's feedback, the graded cell's
output, was correct, and that the typical wrong answer of ``answers.toml`` gets its hint.

Exits non-zero, naming the lab and the exercise, when a lab's graded cells and its answers
differ in number or order, when a reference answer fails its check or a wrong answer passes,
or when any cell of a lab fails. A failed lab's copy is saved with its checking cells, for a
look at what went wrong.

    python solutions/build.py                      # every lab
    python solutions/build.py --labs 01_gpu_memory,03_batching
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

import graded

OUT = Path(__file__).resolve().parent / "_build"
SOLUTION_TAG = "solution"


def instructor_copy(notebook: Path, pairs: list[tuple[graded.GradedCell, graded.Solution]]):
    """The lab with its answers filled in and a checking cell after each graded cell."""
    nb = nbformat.read(notebook, as_version=4)
    for cell, solution in reversed(pairs):  # from the end, so the indices still hold
        answered = nb.cells[cell.index]
        answered.source = graded.substitute(cell, solution.answer)
        answered.metadata.setdefault("tags", []).append(SOLUTION_TAG)
        verify = nbformat.v4.new_code_cell(graded.verify_source(cell, solution))
        # raises-exception: nbclient goes on after a failed check, so one run reports all.
        verify.metadata["tags"] = [graded.VERIFY_TAG, "raises-exception"]
        verify.metadata[graded.VERIFY_TAG] = cell.where
        nb.cells.insert(cell.index + 1, verify)
    return nb


def _is_verify(cell) -> bool:
    return graded.VERIFY_TAG in cell.metadata.get("tags", [])


def _error(cell) -> str | None:
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            return f"{output.ename}: {output.evalue}"
    return None


def run_lab(notebook: Path, pairs, timeout_s: int) -> list[str]:
    """Run the instructor copy of ``notebook``; returns the failures, each naming the lab
    and the exercise or cell. Saves the copy under ``OUT``."""
    lab = graded.lab_name(notebook)
    nb = instructor_copy(notebook, pairs)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(notebook.parent)}})
    failures = []
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        original = -1  # the failing cell's index in the student's notebook
        for cell in nb.cells:
            original += not _is_verify(cell)
            if not _is_verify(cell) and _error(cell):
                failures.append(f"{lab}, cell {original} failed: {_error(cell)}")
                break
        else:
            failures.append(f"{lab} failed: {str(err).strip().splitlines()[-1]}")
    for cell in nb.cells:
        if _is_verify(cell) and _error(cell):
            failures.append(f"{cell.metadata[graded.VERIFY_TAG]}: {_error(cell)}")
    checked = sum(1 for c in nb.cells
                  if _is_verify(c) and c.get("execution_count") and not _error(c))
    if not failures:
        nb.cells = [c for c in nb.cells if not _is_verify(c)]
        if checked != len(pairs):
            failures.append(f"{lab}: {checked} of {len(pairs)} exercises were checked")
    target = OUT / f"{lab}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return failures


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", default="",
                        help="comma-separated labs to run, e.g. 01_gpu_memory,gpu/sglang "
                             "(default: every lab with graded cells)")
    parser.add_argument("--timeout", type=int, default=1200,
                        help="seconds one cell may run (default 1200)")
    args = parser.parse_args(argv)

    solutions = graded.load_solutions()
    notebooks = {graded.lab_name(nb): nb for nb in graded.lab_notebooks()}
    unknown = set(solutions) - set(notebooks)
    if unknown:
        print(f"{graded.ANSWERS.name} has answers for labs that do not exist: "
              f"{sorted(unknown)}", file=sys.stderr)
        return 1
    # Every lab is paired first: a new exercise without an answer fails before anything runs.
    paired = {}
    try:
        for lab, notebook in notebooks.items():
            paired[lab] = graded.pair(lab, graded.graded_cells(notebook), solutions)
    except graded.SolutionError as err:
        print(f"solutions: {err}", file=sys.stderr)
        return 1
    selected = [s.strip() for s in args.labs.split(",") if s.strip()] or list(notebooks)
    missing = [lab for lab in selected if lab not in notebooks]
    if missing:
        print(f"--labs: no such lab {missing}; the labs are {sorted(notebooks)}",
              file=sys.stderr)
        return 1

    failures, exercises, started = [], 0, time.monotonic()
    for lab in selected:
        if not paired[lab]:
            print(f"{lab}: no graded cells")
            continue
        t0 = time.monotonic()
        print(f"{lab}: running {_count(len(paired[lab]), 'exercise')} ...", flush=True)
        lab_failures = run_lab(notebooks[lab], paired[lab], args.timeout)
        verdict = "FAILED" if lab_failures else "every reference answer correct"
        print(f"{lab}: {verdict} ({time.monotonic() - t0:.0f} s)", flush=True)
        for failure in lab_failures:
            print(f"  {failure}", flush=True)
        failures += lab_failures
        exercises += len(paired[lab])
    total = f"{time.monotonic() - started:.0f} s"
    if failures:
        print(f"\nsolutions: {len(failures)} failure(s) ({total}):", file=sys.stderr)
        for failure in failures:
            print(f"  {failure}", file=sys.stderr)
        return 1
    labs = sum(bool(paired[lab]) for lab in selected)
    print(f"\nsolutions: {_count(exercises, 'exercise')} in {_count(labs, 'lab')}, "
          f"every reference answer passes its check and every wrong answer gets its "
          f"hint ({total}); instructor copies in {OUT.relative_to(graded.ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
