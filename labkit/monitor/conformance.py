"""Does a server export vLLM's metrics, and can a query match them? (:ref:`ch08-metrics`)

A dashboard or an alert written for vLLM only works if the server exports the names it
queries, with the same types, labels and histogram bucket edges. This module holds vLLM v1's
metrics as a data table (``labkit/data/vllm_metrics.json``, read from vLLM 0.32.0's
``vllm/v1/metrics/loggers.py`` and ``buckets.py``; the file names its source and date) and
checks against it:

* :func:`check_exposition`: a ``/metrics`` page, family by family: missing, extra, wrong
  type, wrong labels, wrong bucket edges, a counter whose samples lack ``_total``;
* :func:`lint_queries`: PromQL expressions (rules, dashboard panels) that name a deprecated
  metric (``vllm:gpu_cache_usage_perc``, removed in vLLM 0.12) or a name no known metric
  exposes, so the query can never match;
* :func:`lint_substring_lookups`: the tutorial's way of reading metrics (the first line whose
  text *contains* a word), applied to the names vLLM exposes: which words find nothing.

Exposed names follow the Prometheus text format as ``prometheus_client`` writes it: a counter
``vllm:prompt_tokens`` is exposed as ``vllm:prompt_tokens_total`` (plus a ``_created``
timestamp), a histogram ``h`` as ``h_bucket{le=...}``, ``h_sum``, ``h_count``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from prometheus_client.parser import text_string_to_metric_families

from labkit.checks import ParameterError
from labkit.data import read_json

#: Series every Prometheus scrape adds to each target (Prometheus docs, "Jobs and
#: instances": ``up``, ``scrape_duration_seconds``, ``scrape_samples_scraped``,
#: ``scrape_samples_post_metric_relabeling``, ``scrape_series_added``).
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                           "scrape_samples_post_metric_relabeling", "scrape_series_added"})

@dataclass(frozen=True)
class MetricSpec:
    """One vLLM metric as its source declares it. ``labels`` is ``None`` where the label
    names are not fixed (``vllm:cache_config_info``: the cache config's fields);
    ``condition`` says when vLLM creates it, ``None`` meaning always."""

    name: str
    type: str
    labels: tuple[str, ...] | None
    buckets: str | None = None       # the bucket family in vllm/v1/metrics/buckets.py
    condition: str | None = None

    def exposed_names(self) -> frozenset[str]:
        """The sample names a query may use for this metric."""
        if self.type == "counter":
            return frozenset({self.name + "_total", self.name + "_created"})
        if self.type == "histogram":
            return frozenset(self.name + s for s in ("_bucket", "_sum", "_count", "_created"))
        return frozenset({self.name})


@dataclass(frozen=True)
class DeprecatedMetric:
    name: str
    replacement: str | None
    deprecated_in: str
    removed_in: str
    source: str


@dataclass(frozen=True)
class Reference:
    """vLLM's metric table: metrics by name, bucket edges by family, deprecated names."""

    metrics: Mapping[str, MetricSpec]
    bucket_families: Mapping[str, tuple[float, ...] | str]
    deprecated: Mapping[str, DeprecatedMetric]
    source: str
    version: str
    as_of: str

    def exposed_names(self) -> frozenset[str]:
        return frozenset().union(*(m.exposed_names() for m in self.metrics.values()))


@lru_cache(maxsize=1)
def load_reference() -> Reference:
    """vLLM 0.32.0's metrics from ``labkit/data/vllm_metrics.json`` (chapter 8)."""
    data = read_json("vllm_metrics.json")
    metrics = {row["name"]: MetricSpec(row["name"], row["type"],
                                       None if row["labels"] is None else tuple(row["labels"]),
                                       row.get("buckets"), row.get("condition"))
               for row in data["metrics"]}
    families = {k: (v if isinstance(v, str) else tuple(float(x) for x in v))
                for k, v in data["bucket_families"].items()}
    deprecated = {row["name"]: DeprecatedMetric(**row) for row in data["deprecated"]}
    return Reference(metrics, families, deprecated, data["source"], data["version"],
                     data["as_of"])


def one_two_five(max_value: float) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's token-count buckets, capped at
    the model's ``max_model_len`` (vllm/v1/metrics/buckets.py, ``build_1_2_5_buckets``)."""
    if not max_value >= 1:
        raise ParameterError("max_model_len", f"max_model_len must be >= 1, got {max_value!r}")
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(float(e) for e in edges)
            edges.append(mantissa * scale)
        scale *= 10


# -- a /metrics page against the table ------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One way a page differs from vLLM: ``kind`` is ``missing``, ``extra``, ``type``,
    ``labels``, ``buckets`` or ``suffix``."""

    metric: str
    kind: str
    expected: str
    found: str


@dataclass
class ConformanceReport:
    """What :func:`check_exposition` found; ``skipped`` lists the conditional metrics not
    required (with their condition)."""

    differences: list[Difference] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences

    def of_kind(self, kind: str) -> list[Difference]:
        return [d for d in self.differences if d.kind == kind]

    def __str__(self) -> str:
        lines = [f"{len(self.checked)} metrics checked, {len(self.differences)} differences"]
        lines += [f"  {d.kind:8} {d.metric}: expected {d.expected}, found {d.found}"
                  for d in self.differences]
        return "\n".join(lines)


def check_exposition(text: str, *, max_model_len: int | None = None,
                     prefix: str = "vllm:",
                     reference: Reference | None = None) -> ConformanceReport:
    """Compare a ``/metrics`` page with vLLM's metrics (chapter 8).

    Every family whose name starts with ``prefix`` is checked against the table: type,
    label names (``le`` aside), bucket edges (``+Inf`` aside), and ``_total`` on a counter's
    samples. Metrics vLLM always creates and the page lacks are ``missing``; ``prefix``
    families vLLM does not have are ``extra``. Token-count histograms have 1-2-5 edges up to
    ``max_model_len``; without it, any 1-2-5 series is accepted.
    """
    ref = reference or load_reference()
    # prometheus_client's parser, not labkit.http.metrics: conformance needs whole families
    # (each one's TYPE, its label names and a histogram's bucket edges), where the gateway
    # and the monitors need only the samples' values.
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except ValueError as error:
        raise ParameterError("text", f"text is not Prometheus exposition format: {error}") \
            from None
    # prometheus_client's parser renames a counter's samples to ``<name>_total`` whatever the
    # page says, so the suffix is checked on the names as written: the text before ``{`` or
    # the first space of each sample line.
    written = {line.split("{", 1)[0].split()[0] for line in text.splitlines()
               if line.strip() and not line.startswith("#")}
    report = ConformanceReport()
    for name, spec in ref.metrics.items():
        if name not in families:
            if spec.condition is None:
                report.differences.append(Difference(name, "missing", spec.type, "absent"))
            else:
                report.skipped[name] = spec.condition
            continue
        report.checked.append(name)
        report.differences += _compare(spec, families[name], ref, max_model_len, written)
    for name, family in families.items():
        # The text format gives each counter's and histogram's ``_created`` timestamp a
        # gauge family of its own: part of the metric, not an extra one.
        owner = ref.metrics.get(name.removesuffix("_created"))
        if name.endswith("_created") and owner is not None and owner.type != "gauge":
            continue
        if name.startswith(prefix) and name not in ref.metrics:
            report.differences.append(Difference(name, "extra", "absent", family.type))
    return report


def _compare(spec: MetricSpec, family, ref: Reference, max_model_len: int | None,
             written: set[str]) -> list[Difference]:
    out = []
    if family.type != spec.type:
        return [Difference(spec.name, "type", spec.type, family.type)]
    labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
    if spec.labels is not None and labels != sorted(spec.labels):
        out.append(Difference(spec.name, "labels", str(sorted(spec.labels)), str(labels)))
    if spec.type == "counter":
        if spec.name in written:
            out.append(Difference(spec.name, "suffix", spec.name + "_total", spec.name))
    if spec.type == "histogram":
        edges = tuple(sorted({float(s.labels["le"]) for s in family.samples
                              if s.name.endswith("_bucket") and s.labels.get("le") != "+Inf"}))
        expected = ref.bucket_families[spec.buckets]
        if isinstance(expected, str):   # 1-2-5 up to max_model_len
            expected = one_two_five(max_model_len if max_model_len is not None
                                    else (edges[-1] if edges else 1))
        if edges != expected:
            out.append(Difference(spec.name, "buckets", _edges(expected), _edges(edges)))
    return out


def _edges(edges: Sequence[float]) -> str:
    return "(" + ", ".join(f"{e:g}" for e in edges) + ")"


# -- linting PromQL -------------------------------------------------------------------------

# Words that are PromQL syntax, not metric names (prometheus/prometheus, promql/parser/lex.go:
# key, aggregator and modifier keywords).
_KEYWORDS = frozenset({
    "and", "or", "unless", "atan2", "by", "without", "on", "ignoring", "group_left",
    "group_right", "bool", "offset", "start", "end", "inf", "nan",
    "sum", "avg", "count", "min", "max", "group", "stddev", "stdvar", "topk", "bottomk",
    "count_values", "quantile", "limitk", "limit_ratio"})
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (chapter 8).

    A small scanner, enough for lint: it skips strings, label matchers ``{...}``, ranges
    ``[...]``, function names (a word before ``(``), keywords and the label lists of
    ``by (...)``/``on (...)``; what is left are metric names. ``{__name__="x"}`` selectors
    are not resolved.
    """
    names, i, n = set(), 0, len(expr)
    after_grouping = False
    while i < n:
        c = expr[i]
        if c in "\"'`":
            end = expr.find(c, i + 1)
            while end != -1 and c != "`" and expr[end - 1] == "\\":
                end = expr.find(c, end + 1)
            if end == -1:
                raise ParameterError("expr", f"expr has an unterminated string: {expr!r}")
            i = end + 1
        elif c in "{[":
            end = expr.find("}" if c == "{" else "]", i)
            if end == -1:
                raise ParameterError("expr", f"expr has an unclosed {c!r}: {expr!r}")
            i = end + 1
        elif c == "(" and after_grouping:
            i = expr.index(")", i) + 1
            after_grouping = False
        elif c.isalpha() or c in "_:":
            j = i
            while j < n and (expr[j].isalnum() or expr[j] in "_:"):
                j += 1
            word, k = expr[i:j], j
            while k < n and expr[k].isspace():
                k += 1
            if word.lower() in _GROUPING:
                after_grouping = True
            elif not (k < n and expr[k] == "(") and word.lower() not in _KEYWORDS:
                names.add(word)
            i = j
        elif c.isdigit() or c == ".":
            # A number, or a duration such as 5m after ``offset``.
            while i < n and (expr[i].isalnum() or expr[i] in ".+-eE"):
                i += 1
        else:
            i += 1
    return names


@dataclass(frozen=True)
class LintFinding:
    """One problem with one query: ``deprecated`` (with the replacement) or ``unknown``
    (no known metric exposes that name: the query returns nothing, and an alert on it
    never fires)."""

    where: str
    metric: str
    kind: str
    message: str


def known_names(extra: Iterable[str] = (), reference: Reference | None = None) -> frozenset[str]:
    """Every name a query may select: vLLM's exposed names, the chapter 5 gateway's and the
    series Prometheus adds to each scrape, plus ``extra``."""
    from labkit.gateway.server import GatewayMetrics

    gateway = frozenset().union(*(MetricSpec(f.name, f.type, None).exposed_names()
                                  for f in GatewayMetrics().registry.collect()))
    ref = reference or load_reference()
    return ref.exposed_names() | SCRAPE_SERIES | gateway | set(extra)


def lint_queries(queries: Mapping[str, str], *, extra_known: Iterable[str] = (),
                 reference: Reference | None = None) -> list[LintFinding]:
    """Deprecated and unmatchable metric names in ``queries`` (``{where: expr}``: a rule
    name, a panel title), chapter 8. Recording-rule outputs can be passed as
    ``extra_known``."""
    ref = reference or load_reference()
    known = known_names(extra_known, ref)
    findings = []
    for where, expr in queries.items():
        for name in sorted(metric_names_in(expr)):
            base = _strip_suffix(name)
            old = ref.deprecated.get(name) or ref.deprecated.get(base)
            if old is not None:
                instead = f", use {old.replacement}" if old.replacement else ""
                findings.append(LintFinding(where, name, "deprecated",
                                            f"{old.name} was deprecated in vLLM "
                                            f"{old.deprecated_in} and removed in "
                                            f"{old.removed_in}{instead} ({old.source})"))
            elif name not in known:
                hint = (f"; the counter is exposed as {base}_total"
                        if base in ref.metrics and ref.metrics[base].type == "counter" else "")
                findings.append(LintFinding(where, name, "unknown",
                                            f"no known metric exposes {name}{hint}"))
    return findings


def _strip_suffix(name: str) -> str:
    for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def lint_substring_lookups(words: Iterable[str], *,
                           reference: Reference | None = None) -> dict[str, list[str]]:
    """For each word, the vLLM sample names that contain it: what the tutorial's
    substring search would find (chapter 8). An empty list means the lookup can never
    succeed on a vLLM server; more than one means it silently takes whichever comes first."""
    names = sorted((reference or load_reference()).exposed_names())
    return {word: [n for n in names if word in n] for word in words}


__all__ = ["ConformanceReport", "DeprecatedMetric", "Difference", "LintFinding", "MetricSpec",
           "Reference", "SCRAPE_SERIES", "check_exposition",
           "known_names", "lint_queries", "lint_substring_lookups", "load_reference",
           "metric_names_in", "one_two_five"]
