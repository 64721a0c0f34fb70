"""The package's data tables, read in one place (every chapter).

Each table is a CSV or JSON file beside this module, one row per item with its ``source`` and
``as_of`` date (``CONTRIBUTING.md``, "One home per idea"). Readers here return plain rows; the
module that owns a table turns its rows into records.
"""

from __future__ import annotations

import csv
import json
from importlib import resources

#: The course's edition (year and month). A row's ``as_of`` may not come after it.
EDITION = "2026-12"

#: The oldest ``as_of`` a row may have in this edition: older rows need a newer source, or a
#: note that says none exists (:data:`NO_NEWER_SOURCE` in their ``notes``). Both dates are
#: written here, never read from the clock, so that the tables cannot go stale by themselves
#: between two editions (``tests/test_data_sources.py``).
OLDEST_AS_OF = "2025-01-01"

#: The words a row's ``notes`` carry when it stays older than :data:`OLDEST_AS_OF` because
#: nothing newer has been published.
NO_NEWER_SOURCE = "no newer source"


def read_text(name: str) -> str:
    """The text of the data file ``name`` (e.g. ``"gpus.csv"``), UTF-8."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def read_csv(name: str) -> list[dict[str, str]]:
    """The rows of the CSV table ``name``, each a ``{column: text}`` dict in file order."""
    return list(csv.DictReader(read_text(name).splitlines()))


def read_json(name: str):
    """The parsed JSON document ``name`` (a schema, a model table)."""
    return json.loads(read_text(name))
