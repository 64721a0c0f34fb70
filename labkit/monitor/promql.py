"""The PromQL that labkit evaluates itself, where Prometheus is not installed
(:ref:`ch08-scraping`).

``evaluate`` answers the query shapes of :data:`SUPPORTED_QUERIES`, the ones chapter 8's
dashboard, rules and lab ask, on a :class:`~labkit.monitor.series.SeriesStore`, with
:mod:`labkit.monitor.series`' functions (``rate()``, ``histogram_quantile()``, ... with
PromQL's exact math). Any other query raises :class:`UnsupportedQuery`: this is not a PromQL
engine, and says so. :class:`~labkit.monitor.fallback.LabkitMonitor` answers its ``query``
with it, and the tests hold its answers equal to the real Prometheus' on the same samples.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

from labkit.checks import ParameterError
from labkit.monitor.base import InstantVector, QueryResult
from labkit.monitor.prometheus import INSTALL_HINT
from labkit.monitor.series import (Labels, SeriesStore, histogram_quantile, labels_of,
                                   latest_values, rate, sum_rate)


class UnsupportedQuery(ParameterError):
    """A PromQL query that ``evaluate`` does not evaluate (it is not a PromQL engine);
    the message lists the shapes it does."""

    def __init__(self, expr: str) -> None:
        shapes = "\n  ".join(SUPPORTED_QUERIES)
        super().__init__("expr", f"expr {expr!r} is not one of the PromQL shapes that "
                                 f"labkit.monitor's scraper evaluates (install Prometheus, "
                                 f"{INSTALL_HINT}, for all of PromQL):\n  {shapes}")


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_MATCHERS = r"(?:\{(?P<matchers>[^}]*)\})?"
_WINDOW = r"\[(?P<window>\d+(?:ms|s|m|h))\]"
_BY = r"(?:\s*by\s*\((?P<by>[^)]*)\))?"

#: The PromQL shapes ``evaluate`` answers, with the labkit function behind each;
#: label matchers are equality only (``{instance="127.0.0.1:8001"}``).
SUPPORTED_QUERIES = (
    "NAME{matchers}                     (latest_values: the newest sample of each series)",
    "NAME{matchers}[WINDOW]             (the raw samples in (t - WINDOW, t])",
    "rate(NAME{matchers}[WINDOW])       (rate, per series)",
    "sum by (LABELS) (NAME{matchers})   (latest_values, summed per group; 'sum(...)' too)",
    "sum by (LABELS) (rate(NAME{matchers}[WINDOW]))   (sum_rate)",
    "histogram_quantile(Q, sum by (le, LABELS) (rate(NAME_bucket{matchers}[WINDOW])))"
    "   (histogram_quantile)",
    "any instant shape above, then > N (or >=, <, <=, ==, !=)   (a filter, as in alert rules)",
)

_PATTERNS = {
    "selector": re.compile(rf"(?P<name>{_NAME}){_MATCHERS}"),
    "range": re.compile(rf"(?P<name>{_NAME}){_MATCHERS}{_WINDOW}"),
    "rate": re.compile(rf"rate\(\s*(?P<name>{_NAME}){_MATCHERS}{_WINDOW}\s*\)"),
    "sum": re.compile(rf"sum{_BY}\s*\(\s*(?P<name>{_NAME}){_MATCHERS}\s*\)"),
    "sum_rate": re.compile(rf"sum{_BY}\s*\(\s*rate\(\s*(?P<name>{_NAME}){_MATCHERS}{_WINDOW}"
                           r"\s*\)\s*\)"),
    "quantile": re.compile(rf"histogram_quantile\(\s*(?P<q>[0-9.]+)\s*,\s*sum{_BY}\s*\(\s*"
                           rf"rate\(\s*(?P<name>{_NAME})_bucket{_MATCHERS}{_WINDOW}\s*\)\s*\)"
                           r"\s*\)"),
}

_COMPARISON = re.compile(r"(?P<inner>.*?)\s*(?P<op>>=|<=|==|!=|>|<)\s*"
                         r"(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
_OPERATORS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
              "==": operator.eq, "!=": operator.ne}
_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _window_s(text: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", text).groups()
    return int(number) * _UNITS_S[unit]


def _matchers(text: str | None, expr: str) -> dict[str, str]:
    if not text or not text.strip():
        return {}
    out = {}
    for part in text.split(","):
        match = re.fullmatch(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"\s*', part)
        if match is None:  # !=, =~, !~ or anything else: not ours to evaluate
            raise UnsupportedQuery(expr)
        out[match[1]] = match[2]
    return out


def _by(text: str | None) -> tuple[str, ...]:
    return tuple(label.strip() for label in (text or "").split(",") if label.strip())


def _group(values: dict[Labels, float], by: Sequence[str]) -> InstantVector:
    """``sum by (by) (values)``."""
    out: InstantVector = {}
    for labels, value in values.items():
        found = dict(labels)
        key = labels_of({k: found[k] for k in by if k in found})
        out[key] = out.get(key, 0.0) + value
    return out


def evaluate(store: SeriesStore, expr: str, at_s: float) -> QueryResult:
    """One of :data:`SUPPORTED_QUERIES` on ``store`` at ``at_s``, with labkit.monitor's
    functions (chapter 8); any other query raises :class:`UnsupportedQuery`."""
    text = expr.strip()
    compared = _COMPARISON.fullmatch(text)
    if compared is not None:
        # PromQL's filter: keep the elements for which the comparison holds (NaN never does).
        values = evaluate(store, compared["inner"], at_s)
        if any(isinstance(v, list) for v in values.values()):
            raise UnsupportedQuery(expr)
        test, number = _OPERATORS[compared["op"]], float(compared["number"])
        return {k: v for k, v in values.items() if test(v, number)}
    found = {kind: pattern.fullmatch(text) for kind, pattern in _PATTERNS.items()}
    kind = next((k for k, m in found.items() if m is not None), None)
    if kind is None:
        raise UnsupportedQuery(expr)
    m = found[kind]
    name, matchers = m["name"], _matchers(m["matchers"], expr)
    if kind == "selector":
        return latest_values(store, name, at_s, **matchers)
    if kind == "sum":
        return _group(latest_values(store, name, at_s, **matchers), _by(m["by"]))
    window_s = _window_s(m["window"])
    if kind == "range":
        windows = {series.labels: series.window(at_s - window_s, at_s)
                   for series in store.select(name, **matchers)}
        return {labels: samples for labels, samples in windows.items() if samples}
    if kind == "rate":
        out = {}
        for series in store.select(name, **matchers):
            value = rate(series, window_s, at_s)
            if value is not None:
                out[series.labels] = value
        return out
    if kind == "sum_rate":
        by = _by(m["by"])
        return {labels_of(dict(k)): v
                for k, v in sum_rate(store, name, window_s, at_s, by=by, **matchers).items()}
    by = _by(m["by"])
    if "le" not in by:  # without le the buckets are summed away: PromQL returns nothing
        raise UnsupportedQuery(expr)
    q = float(m["q"])
    values = histogram_quantile(q, store, name, at_s, window_s=window_s,
                                by=tuple(b for b in by if b != "le"), **matchers)
    return {labels_of(dict(k)): v for k, v in values.items()}
