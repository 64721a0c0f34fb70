"""What the bill leaves out: an API, cloud GPUs or your own servers, compared on elasticity,
lead time, data residency, GPU availability and skills (:ref:`ch07-beyond-cost`).

Chapter 7's costs answer "which is cheapest for this traffic"; a team also asks how fast it
can grow, how long until capacity exists, where its users' data goes, whether the GPUs will be
there, and who must run what. ``labkit/data/deploy_tradeoffs.csv`` holds one sourced, dated
fact per factor and option: the table a decision starts from, not a score that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.checks import ParameterError
from labkit.data import read_csv

#: The three ways to serve of chapter 7, in the order of its tables.
OPTIONS = ("api", "cloud", "self-hosted")


@dataclass(frozen=True)
class Tradeoff:
    """One sourced fact about one option on one factor; ``value`` and ``unit`` carry the number
    a calculation uses, where the fact has one (``value`` is None otherwise)."""

    factor: str
    option: str
    fact: str
    value: float | None
    unit: str
    source: str
    as_of: str
    notes: str


@lru_cache(maxsize=1)
def tradeoffs() -> tuple[Tradeoff, ...]:
    """Every row of ``deploy_tradeoffs.csv``, in table order (:ref:`ch07-beyond-cost`)."""
    return tuple(Tradeoff(factor=r["factor"], option=r["option"], fact=r["fact"],
                          value=float(r["value"]) if r["value"] else None, unit=r["unit"],
                          source=r["source"], as_of=r["as_of"], notes=r["notes"])
                 for r in read_csv("deploy_tradeoffs.csv"))


def factors() -> list[str]:
    """The factors of the table, in table order."""
    return list(dict.fromkeys(t.factor for t in tradeoffs()))


def tradeoff(factor: str, option: str) -> Tradeoff:
    """The fact for ``option`` (one of :data:`OPTIONS`) on ``factor``."""
    if option not in OPTIONS:
        raise ParameterError("option", f"option must be one of {OPTIONS}, got {option!r}")
    for row in tradeoffs():
        if row.factor == factor and row.option == option:
            return row
    raise ParameterError("factor", f"factor must be one of {factors()}, got {factor!r}")


def tradeoff_table() -> str:
    """The decision table as Markdown: a row per factor, a column per option, each cell the
    fact and a link to its source with its date (:ref:`ch07-beyond-cost`)."""
    lines = ["| factor | " + " | ".join(OPTIONS) + " |", "|---" * (len(OPTIONS) + 1) + "|"]
    for factor in factors():
        cells = []
        for option in OPTIONS:
            row = tradeoff(factor, option)
            fact = row.fact.replace("$", "\\$")  # not math, in Jupyter or MyST
            cells.append(f"{fact} ([{row.source.split('/')[2]}]({row.source}), {row.as_of})")
        lines.append(f"| {factor} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
