"""Every number in labkit's data tables has a source and a date of this edition (chapters 1-8).

A row's ``as_of`` is the date of what its ``source`` says (a price list's update, a report's
publication, the day a page was read). It must come between ``OLDEST_AS_OF`` and the
``EDITION``, both written in ``labkit.data``, never taken from today's clock, so the suite
cannot turn red on its own; a row older than that stays only with a note saying that no newer
source exists, or while it is listed in ``STALE_ROWS`` with what its update will be (a list
that can only shrink).
"""

import csv
import json
import re
from pathlib import Path

import pytest

import labkit.data
from labkit.data import EDITION, NO_NEWER_SOURCE, OLDEST_AS_OF, read_csv, read_json

DATA = Path(labkit.data.__file__).parent
DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")
#: Trace files keep their publisher's columns; ``traces.csv`` sources and dates them.
TRACE_FILES = {row["file"] for row in read_csv("traces.csv")}
TABLES = sorted(p.name for p in DATA.glob("*.csv") if p.name not in TRACE_FILES)


#: Rows older than ``OLDEST_AS_OF`` still waiting for their update, each with what a search of
#: December 2026 found (a newer figure changes chapter 7's results and lab 07's stored table,
#: so they move together). The list may only shrink: a row brought up to date must leave it.
#: A newer source exists for these (EIA publishes every state's 2024 figure) but was not
#: reachable here; rows for which none exists say so in their notes instead.
STALE_ROWS = {
    **{("tco_inputs.csv", f"electricity_usd_kwh | {price} | USD/kWh | {state}, industrial, "
                          f"average revenue per kWh, 2023 | 2024-10-17"):
       "EIA's Electric Power Annual with 2024 data (October 2025): its state table was not found "
       "in December 2026, only its US and California figures"
       for price, state in (("0.0575", "New Mexico"), ("0.0660", "Texas"), ("0.0892", "Virginia"))},
}


def row_key(table: str, row: dict[str, str]) -> tuple[str, str]:
    """A row by its first four columns and its date (two rows may share the four)."""
    return table, " | ".join([*list(row.values())[:4], row["as_of"]])


def check_row(where: str, source: str, as_of: str, notes: str = "", stale: bool = False) -> None:
    """``stale``: a row of :data:`STALE_ROWS`, which must still be old."""
    assert source.strip(), f"{where}: no source"
    assert DATE.match(as_of), f"{where}: as_of {as_of!r} is not YYYY-MM or YYYY-MM-DD"
    assert as_of[:7] <= EDITION, f"{where}: as_of {as_of} comes after the edition {EDITION}"
    if stale:
        assert as_of < OLDEST_AS_OF, f"{where} is up to date: drop it from STALE_ROWS"
        return
    assert as_of >= OLDEST_AS_OF or NO_NEWER_SOURCE in notes.lower(), (
        f"{where}: as_of {as_of} is older than {OLDEST_AS_OF}: cite a newer source, or say in "
        f"its notes that there is {NO_NEWER_SOURCE!r} and why")


@pytest.mark.parametrize("table", TABLES)
def test_every_row_of_every_table_has_a_source_and_a_date(table):
    rows = read_csv(table)
    assert rows, table
    assert {"source", "as_of"} <= set(rows[0]), f"{table} needs source and as_of columns"
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        check_row(f"{table}:{i}", row["source"], row["as_of"], row.get("notes") or "",
                  stale=row_key(table, row) in STALE_ROWS)


def test_every_stale_row_still_exists():
    keys = {row_key(table, row) for table in TABLES for row in read_csv(table)}
    assert set(STALE_ROWS) <= keys, set(STALE_ROWS) - keys


def test_json_tables_and_schemas_have_a_source_and_a_date():
    for model in read_json("models.json")["models"]:
        check_row(f"models.json {model['name']}", model["params_source"], model["as_of"])
    metrics = read_json("vllm_metrics.json")
    check_row("vllm_metrics.json", metrics["source"], metrics["as_of"])
    for schema in sorted(DATA.glob("*.schema.json")):
        comment = json.loads(schema.read_text())["$comment"]
        copied = re.search(r"copied (\d{4}-\d{2}-\d{2})", comment)
        assert copied, f"{schema.name}: its $comment says where it comes from and when copied"
        check_row(schema.name, comment, copied.group(1))


def test_traces_are_the_files_traces_csv_sources():
    for name in TRACE_FILES:
        with (DATA / name).open(encoding="utf-8") as f:
            assert next(csv.reader(f)) == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def test_the_check_fails_on_a_row_without_source_or_date():
    """The rule can fail: each way a row breaks it, named."""
    for args, message in ((("", "2026-01"), "no source"),
                          (("s", "Dec 2026"), "not YYYY-MM"),
                          (("s", "2027-01-01"), "after the edition"),
                          (("s", "2022-05"), "older than")):
        with pytest.raises(AssertionError, match=message):
            check_row("row", *args)
    check_row("row", "s", "2022-05", f"the series ended in 2022: {NO_NEWER_SOURCE}")
