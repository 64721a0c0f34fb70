"""A ``/metrics`` page read into numbers (chapters 2, 5 and 8).

vLLM, ``labkit serve`` and ``labkit gateway`` expose Prometheus' text format; every reader in
labkit goes through ``prometheus_client``'s parser here, never a regular expression. Sample
names are the exposed ones (``vllm:prefix_cache_hits_total``,
``vllm:e2e_request_latency_seconds_count``), the names PromQL queries use; vLLM labels each
data-parallel engine separately, so a server's total is the sum over label sets.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client.parser import text_string_to_metric_families

from labkit.checks import ParameterError

#: What a counter's or histogram's sample names add to its family's name.
_SAMPLE_SUFFIXES = ("_total", "_created", "_count", "_sum", "_bucket", "_gcount", "_gsum")


def _family_name(sample_name: str) -> str:
    for suffix in _SAMPLE_SUFFIXES:
        if sample_name.endswith(suffix):
            return sample_name[:-len(suffix)]
    return sample_name


def _lines_for(text: str, names: Collection[str]) -> str:
    """Only the lines of the families that samples ``names`` belong to: parsing a whole
    ``labkit serve`` page takes about 1.5 ms, its few wanted lines a tenth of that, and a
    gateway reads each backend's page many times a second."""
    wanted = tuple({_family_name(n) for n in names})
    # "# HELP name ..." and "# TYPE name ..." carry the name after 7 characters.
    return "\n".join(line for line in text.splitlines()
                     if (line[7:] if line.startswith("#") else line).startswith(wanted)) + "\n"


def parse_samples(text: str, names: Collection[str] | None = None
                  ) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on a ``/metrics`` page as ``(name, labels, value)``, or only those named
    ``names``. A page the parser rejects raises :class:`~labkit.checks.ParameterError`."""
    source = text if names is None else _lines_for(text, names)
    try:
        samples = [(s.name, dict(s.labels), float(s.value))
                   for family in text_string_to_metric_families(source)
                   for s in family.samples]
    except ValueError as error:
        raise ParameterError("text", f"text is not Prometheus exposition format: {error}") \
            from None
    return samples if names is None else [s for s in samples if s[0] in names]


def sample_totals(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """``{sample name: sum over label sets}`` for the samples ``names`` (all when ``None``).
    A name the page lacks is left out; values are as exposed (``NaN`` stays ``NaN``)."""
    totals: dict[str, float] = {}
    for name, _, value in parse_samples(text, names):
        totals[name] = totals.get(name, 0.0) + value
    return totals


def totals_by_label(text: str, label: str, names: Collection[str] | None = None
                    ) -> dict[str, dict[str, float]]:
    """``{sample name: {label value: sum}}`` over the samples that carry ``label``, e.g. a
    gateway's counters per ``backend``."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_samples(text, names):
        if label in labels:
            per = out.setdefault(name, {})
            per[labels[label]] = per.get(labels[label], 0.0) + value
    return out
