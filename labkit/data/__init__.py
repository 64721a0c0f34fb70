"""The package's data tables, read in one place (every chapter).

Each table is a CSV or JSON file beside this module, one row per item with its ``source`` and
``as_of`` date (``CONTRIBUTING.md``, "One home per idea"). Readers here return plain rows; the
module that owns a table turns its rows into records.
"""

from __future__ import annotations

import csv
import json
from importlib import resources


def read_text(name: str) -> str:
    """The text of the data file ``name`` (e.g. ``"gpus.csv"``), UTF-8."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def read_csv(name: str) -> list[dict[str, str]]:
    """The rows of the CSV table ``name``, each a ``{column: text}`` dict in file order."""
    return list(csv.DictReader(read_text(name).splitlines()))


def read_json(name: str):
    """The parsed JSON document ``name`` (a schema, a model table)."""
    return json.loads(read_text(name))
