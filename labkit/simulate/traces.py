"""Replayed traces: a production service's arrivals and lengths as a
:class:`~labkit.simulate.Workload` (:ref:`ch03-traces`).

Synthetic arrivals (:func:`~labkit.simulate.arrival_times`) are gamma gaps around a mean
rate; a real service's keep to no mean rate: many requests come together, then few for a
while. A trace keeps that shape. :func:`~labkit.simulate.load_trace` reads two layouts:

- labkit's: ``arrival_time`` (seconds), ``prompt_len`` and ``output_len`` (tokens), in CSV or
  JSON lines;
- Azure's public LLM inference traces (Patel et al., Splitwise, ISCA 2024): ``TIMESTAMP``,
  ``ContextTokens``, ``GeneratedTokens``, the layout of the two excerpts that ship in
  ``labkit/data`` (:data:`TRACES` lists them with their source and licence, CC-BY 4.0).

A trace's burstiness is read from its gaps (:func:`~labkit.simulate.interarrival_cv`): a
Poisson process has a coefficient of variation of 1, and gamma gaps of shape ``k`` have
``1 / sqrt(k)``, so ``1 / cv**2`` is the ``burstiness`` that ``vllm bench serve`` would need
to match it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from labkit.checks import ParameterError
from labkit.data import read_csv, read_text
from labkit.simulate.workload import Workload

#: The traces that ship with labkit, by name: their file in ``labkit/data``, what they hold,
#: where they come from (``traces.csv``).
TRACES = {row["name"]: row for row in read_csv("traces.csv")}

#: Azure's column names and labkit's, in the same order.
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LABKIT_COLUMNS = ("arrival_time", "prompt_len", "output_len")


def load_trace(trace: str | Path, seed: int = 0) -> Workload:
    """A workload from a trace: a name in :data:`~labkit.simulate.traces.TRACES`
    (``"azure-code-2023"``) or a file in either layout (:mod:`labkit.simulate.traces`), put
    in arrival order. Azure's timestamps become seconds after the trace's first request.
    Token ids and words come from ``seed`` (traces rarely ship text)."""
    if str(trace) in TRACES:
        row = TRACES[str(trace)]
        rows = list(csv.DictReader(read_text(row["file"]).splitlines()))
        return _workload(rows, row["name"], float(row["window_s"]), seed)
    path = Path(trace)
    if not path.is_file():
        raise ParameterError("trace", f"trace must be a file or one of {sorted(TRACES)}, "
                                      f"got {str(trace)!r}")
    with path.open(encoding="utf-8-sig") as f:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(f))
        else:
            rows = [json.loads(line) for line in f if line.strip()]
    return _workload(rows, path.name, None, seed)


def _workload(rows: list[dict], name: str, window_s: float | None, seed: int) -> Workload:
    azure = bool(rows) and AZURE_COLUMNS[0] in rows[0]
    columns = AZURE_COLUMNS if azure else LABKIT_COLUMNS
    try:
        times, prompts, outputs = ([r[c] for r in rows] for c in columns)
    except KeyError as err:
        raise ParameterError("trace", f"trace: every row of {name} needs {err.args[0]!r} "
                                      f"(or Azure's {', '.join(AZURE_COLUMNS)})") from None
    if azure:
        stamps = np.array(times, dtype="datetime64[ns]")
        arrival_s = (stamps - stamps.min()) / np.timedelta64(1, "s")
    else:
        arrival_s = np.array(times, dtype=float)
    order = np.argsort(arrival_s, kind="stable")
    return Workload(arrival_s[order], np.array(prompts, dtype=int)[order],
                    np.array(outputs, dtype=int)[order], duration_s=window_s, seed=seed,
                    description=f"trace {name}")


def interarrival_cv(workload: Workload) -> float:
    """The coefficient of variation of the gaps between arrivals (standard deviation over
    mean): 1 for a Poisson process, above 1 for bursts, 0 for a metronome."""
    gaps = np.diff(workload.arrival_s)
    if len(gaps) < 2 or gaps.mean() == 0:
        raise ParameterError("workload", "workload needs at least three arrivals, not all "
                                         "at once, to measure its gaps")
    return float(gaps.std() / gaps.mean())
