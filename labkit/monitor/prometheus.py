"""The real Prometheus on loopback for a lab or a test, or labkit's scraper in its place
(:ref:`ch08-scraping`).

:func:`start_monitor` starts whichever this machine has and returns it, started:

* :class:`PrometheusServer`: the ``prometheus`` binary (Debian's package, 2.42) with the
  scrape config and rules file of :mod:`labkit.monitor.artifacts`, a scrape and rule
  evaluation every second, its storage in a temporary directory, listening on a free port
  of 127.0.0.1. PromQL goes to its HTTP API (``/api/v1/query``, ``/api/v1/query_range``,
  ``/api/v1/alerts``; prometheus/prometheus v2.42.0, ``web/api/v1/api.go``);
* :class:`LabkitMonitor`, when the binary is absent (or ``LABKIT_PROMETHEUS=off`` hides it):
  :class:`~labkit.monitor.scrape.Scraper` into a :class:`~labkit.monitor.series.SeriesStore`
  and a :class:`~labkit.monitor.alerts.RuleEvaluator`, on the same targets, jobs, interval
  and rules. It answers the PromQL shapes in :data:`SUPPORTED_QUERIES` with
  :mod:`labkit.monitor.series`' functions and refuses any other query with
  :class:`UnsupportedQuery`: it is not a PromQL engine, and says so.

Both have the same small interface (``which``, ``query``, ``query_range``, ``alerts``,
``now``, ``wait_scraped``, ``stop``, a context manager), so a lab's cells are the same
whichever ran, and ``which`` says which one that was.

Times are seconds since the monitor's ``origin_s`` (a whole Unix second taken at start):
small numbers for plots, and exact: Prometheus stamps samples in integer milliseconds, and
``(t_ms - origin_ms) / 1000`` keeps the differences that ``rate()`` divides by as exact as
Prometheus' own ``float64(t1 - t0) / 1000``.

Prometheus applies a new config's targets through its discovery manager, which sends updates
every 5 seconds (``updatert``, v2.42.0 ``discovery/manager.go``): the first scrapes come a few
seconds after ``/-/ready``, hence ``wait_scraped()``. ``/api/v1/alerts`` lists the
alerts that are pending or firing (``ActiveAlerts``, v2.42.0 ``rules/alerting.go``): a
resolved alert leaves the list, which :class:`AlertWatcher` records as ``resolved``.

One difference between Prometheus 2.x and 3.x matters when comparing numbers: a range
selector ``x[30s]`` evaluated at ``t`` takes the samples in ``[t - 30s, t]`` in 2.x
(``matrixIterSlice``, ``t >= mint``, v2.42.0 ``promql/engine.go``) and in ``(t - 30s, t]``
since 3.0, as :mod:`labkit.monitor.series` does. They differ only when a sample sits exactly
on ``t - 30s``; the tests pick evaluation times where none does (``time_off_samples()``).
In 2.x ``rate()`` also caps the extrapolation towards a counter's zero before its 1.1-interval
test, 3.x after (``extrapolatedRate``, ``promql/functions.go``); the two agree whenever the
window lies inside the scraped history, as it does in the tests and the lab.
"""

from __future__ import annotations

import abc
import asyncio
import calendar
import json
import math
import operator
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

import httpx

from labkit.checks import ParameterError, in_range, positive_int
from labkit.launch import ServerProcess, free_port, parent_death_hook
from labkit.monitor.alerts import AlertRule, AlertState, RuleEvaluator
from labkit.monitor.artifacts import rules_file, scrape_config
from labkit.monitor.scrape import DEFAULT_SCRAPE_TIMEOUT_S, Scraper, instance_of
from labkit.monitor.series import (Labels, Sample, SeriesStore, histogram_quantile,
                                   labels_of, latest_values, rate, sum_rate)

#: Set to ``off`` to hide the ``prometheus`` binary, so that the fallback runs (the tests
#: and the lab's nbval run use it to check both paths).
PROMETHEUS_ENV = "LABKIT_PROMETHEUS"

#: How to get the binary, for the banner and the error messages.
INSTALL_HINT = "apt-get install prometheus"

#: An instant query's answer: one value per label set (``__name__`` left out).
InstantVector = dict[Labels, float]
#: A range query's or a range selector's answer: samples per label set.
RangeVector = dict[Labels, list[Sample]]
QueryResult = InstantVector | RangeVector


class UnsupportedQuery(ParameterError):
    """A PromQL query that :class:`LabkitMonitor` does not evaluate (it is not a PromQL
    engine); the message lists the shapes it does."""

    def __init__(self, expr: str) -> None:
        shapes = "\n  ".join(SUPPORTED_QUERIES)
        super().__init__("expr", f"expr {expr!r} is not one of the PromQL shapes that "
                                 f"labkit.monitor's scraper evaluates (install Prometheus, "
                                 f"{INSTALL_HINT}, for all of PromQL):\n  {shapes}")


@dataclass(frozen=True)
class ActiveAlert:
    """One alert that is pending or firing now, as ``/api/v1/alerts`` lists it: its rule's
    name, its labels (without ``alertname``), its state, since when its condition has held
    (``active_at_s``, monitor time) and the condition's value at the last evaluation."""

    name: str
    labels: Labels
    state: str
    active_at_s: float
    value: float


def prometheus_binary() -> str | None:
    """The ``prometheus`` executable on ``PATH``, or ``None`` when there is none or
    ``LABKIT_PROMETHEUS=off`` hides it."""
    if os.environ.get(PROMETHEUS_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    return shutil.which("prometheus")


class Monitor(abc.ABC):
    """What both monitors share: the targets, the clock, the rules, waiting for scrapes and
    the context manager. Use :func:`start_monitor`, or one of the two subclasses; ``which``
    is one line saying which one runs, for the lab's banner."""

    def __init__(self, vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                 rules: Sequence[AlertRule] = (), *, scrape_interval_s: float = 1.0) -> None:
        if not vllm_urls:
            raise ParameterError("vllm_urls", "vllm_urls must name at least one server")
        self.vllm_urls, self.gateway_urls = list(vllm_urls), list(gateway_urls)
        self.rules = list(rules)
        self.scrape_interval_s = in_range("scrape_interval_s", scrape_interval_s, 0,
                                          low_open=True)
        self.origin_s = math.floor(time.time())
        self.which = ""

    def now(self) -> float:
        """Seconds since ``origin_s``: the time the monitor would stamp a sample with now."""
        return time.time() - self.origin_s

    @abc.abstractmethod
    def query(self, expr: str, at: float | None = None) -> QueryResult:
        """PromQL ``expr`` at ``at`` (monitor time; default now)."""

    @abc.abstractmethod
    def query_range(self, expr: str, start: float, end: float, step: float) -> RangeVector:
        """``expr`` at ``start``, ``start + step``, ... up to ``end`` (monitor time)."""

    @abc.abstractmethod
    def alerts(self) -> list[ActiveAlert]:
        """The alerts pending or firing now."""

    @abc.abstractmethod
    def start(self) -> Monitor:
        """Start scraping; returns the monitor."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop scraping and release everything the monitor holds."""

    @property
    def instances(self) -> dict[str, str]:
        """``{instance label: job}`` of every target, as both monitors label them."""
        return {**{instance_of(u): "vllm" for u in self.vllm_urls},
                **{instance_of(u): "labkit-gateway" for u in self.gateway_urls}}

    def samples(self, name: str, window_s: float, at: float) -> SeriesStore:
        """The raw samples of every series named ``name`` in the window ``(at - window_s,
        at]`` (the range selector ``name[window]``), as a
        :class:`~labkit.monitor.series.SeriesStore`: labkit.monitor's functions then compute
        on exactly the data the monitor holds. Prometheus 2.x also returns a sample sitting
        exactly on ``at - window_s``; it is left out, as 3.x and labkit leave it out."""
        in_range("window_s", window_s, 0, low_open=True)
        start_ms = round((at - window_s) * 1000)
        store = SeriesStore()
        for labels, samples in self.query(f"{name}[{_seconds(window_s)}]", at=at).items():
            for sample in samples:
                if round(sample.t_s * 1000) > start_ms:
                    store.add(name, dict(labels), sample.t_s, sample.value)
        return store

    def time_off_samples(self, window_s: float, at: float | None = None) -> float:
        """A time at ``at`` (default: one scrape interval ago, so that every target's
        latest scrape is stored) or a few milliseconds before, in whole milliseconds, where
        no scrape lies exactly on ``at - window_s``: there Prometheus 2.x's range selector
        (closed on the left) and 3.x's and labkit's (open) take the same samples."""
        at = self.now() - self.scrape_interval_s if at is None else at
        t_ms = math.floor(at * 1000)
        lookback = _seconds(window_s + 2 * self.scrape_interval_s)
        scrapes = {round(s.t_s * 1000) for samples in self.query(
            f"up[{lookback}]", at=t_ms / 1000).values() for s in samples}
        while t_ms - round(window_s * 1000) in scrapes:
            t_ms -= 1
        return t_ms / 1000

    def wait_scraped(self, rounds: int = 2, timeout_s: float = 30.0) -> None:
        """Wait until every target has been scraped successfully ``rounds`` times (``up``
        is 1 for each, ``count_over_time`` of it at least ``rounds``): before that,
        ``rate()`` has fewer than two samples and answers nothing."""
        positive_int("rounds", rounds)
        window = (rounds + 2) * self.scrape_interval_s
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.query(f"up[{_seconds(window)}]")
            good = {dict(labels).get("instance"): sum(s.value == 1 for s in values)
                    for labels, values in samples.items()}
            if all(good.get(i, 0) >= rounds for i in self.instances):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets not scraped {rounds} times within {timeout_s} s: "
                                   f"{good} ({self.which})")
            time.sleep(self.scrape_interval_s / 4)

    def wait_next_scrape(self, timeout_s: float = 30.0) -> float:
        """Wait until every target has been scraped after this call, so that what happened
        before it (a load that just ended) is in the monitor's samples; returns the time of
        the call."""
        since = self.now()
        lookback = _seconds(2 * self.scrape_interval_s + 1)
        deadline = time.monotonic() + timeout_s
        while True:
            newest = {dict(labels).get("instance"): max(s.t_s for s in samples)
                      for labels, samples in self.query(f"up[{lookback}]").items()}
            if all(newest.get(i, -math.inf) > since for i in self.instances):
                return since
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets not scraped within {timeout_s} s ({self.which})")
            time.sleep(self.scrape_interval_s / 4)

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the real Prometheus ---------------------------------------------------------------------


class PrometheusServer(Monitor):
    """``prometheus`` scraping the targets every ``scrape_interval_s`` and evaluating
    ``rules`` as often, on a free loopback port with a throwaway storage directory
    (chapter 8).

    Started in its own process group and stopped as a whole (SIGTERM, then SIGKILL), and on
    Linux asked to die with the process that started it, so a killed kernel leaves no
    Prometheus behind (:func:`labkit.launch.parent_death_hook`).
    """

    def __init__(self, vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                 rules: Sequence[AlertRule] = (), *, scrape_interval_s: float = 1.0,
                 binary: str | None = None, port: int | None = None,
                 startup_timeout_s: float = 60.0) -> None:
        super().__init__(vllm_urls, gateway_urls, rules, scrape_interval_s=scrape_interval_s)
        self.binary = binary or prometheus_binary()
        if self.binary is None:
            raise FileNotFoundError(f"prometheus is not installed ({INSTALL_HINT}; elsewhere "
                                    f"prometheus.io/download), or {PROMETHEUS_ENV}=off hides it")
        self.port = free_port() if port is None else port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = in_range("startup_timeout_s", startup_timeout_s, 0,
                                          low_open=True)
        self.version = ""
        self.which = f"Prometheus (not started) at 127.0.0.1:{self.port}"
        self._folder: tempfile.TemporaryDirectory | None = None
        self._server: ServerProcess | None = None
        self._client: httpx.Client | None = None

    def command(self, folder: str) -> list[str]:
        """The command line: config and storage in ``folder``, loopback only, warnings only
        in the log (flags of prometheus 2.42, ``cmd/prometheus/main.go``)."""
        return [self.binary, f"--config.file={os.path.join(folder, 'prometheus.yml')}",
                f"--storage.tsdb.path={os.path.join(folder, 'data')}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]

    def write_config(self, folder: str) -> None:
        """``prometheus.yml`` (and ``rules.yml`` when there are rules) into ``folder``."""
        import yaml  # the ``gateway`` extra

        rule_files = []
        if self.rules:
            rule_files = [os.path.join(folder, "rules.yml")]
            with open(rule_files[0], "w", encoding="utf-8") as f:
                yaml.safe_dump(rules_file(self.rules), f, sort_keys=False)
        config = scrape_config(self.vllm_urls, self.gateway_urls,
                               scrape_interval_s=self.scrape_interval_s, rule_files=rule_files)
        with open(os.path.join(folder, "prometheus.yml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False)

    def start(self) -> PrometheusServer:
        """Write the config, start Prometheus and wait for ``/-/ready`` (its TSDB open and
        the config loaded); a started server is kept."""
        if self._server is not None:
            return self
        self._folder = tempfile.TemporaryDirectory(prefix="labkit-prometheus-")
        self._client = httpx.Client(base_url=self.base_url, timeout=30, trust_env=False)
        self.write_config(self._folder.name)
        server = ServerProcess(self.command(self._folder.name), self.base_url)
        # ServerProcess waits for /health, which Prometheus does not serve: start it the same
        # way (own process group, dies with its parent) and wait for /-/ready instead.
        with open(server.log_path, "a") as log:
            server.process = subprocess.Popen(server.command, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=parent_death_hook())
        self._server = server
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                log = server.log_tail()
                self.stop()
                raise RuntimeError(f"prometheus exited with code {server.process.returncode}:"
                                   f"\n{log}")
            try:
                if self._client.get("/-/ready", timeout=2).status_code == 200:
                    info = self._api("/api/v1/status/buildinfo")
                    self.version = info["version"]
                    self.which = f"Prometheus {self.version} at 127.0.0.1:{self.port}"
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        log = server.log_tail()
        self.stop()
        raise TimeoutError(f"prometheus not ready after {self.startup_timeout_s} s:\n{log}")

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM to its process group), delete its storage and close
        the HTTP client."""
        if self._server is not None:
            self._server.stop(grace_s=10)
            os.unlink(self._server.log_path)
            self._server = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def log_tail(self, lines: int = 30) -> str:
        """The last lines Prometheus logged (warnings and errors)."""
        return "" if self._server is None else self._server.log_tail(lines)

    # -- the HTTP API -----------------------------------------------------------------------

    def _api(self, path: str, **params: str):
        if self._client is None:
            raise RuntimeError("prometheus is not running: start() it first")
        response = self._client.get(path, params=params)
        # Timestamps as Decimal: a float has only microsecond precision at 1.7e9 seconds.
        body = json.loads(response.text, parse_float=Decimal)
        if body.get("status") != "success":
            raise ParameterError("expr", f"Prometheus refused {params.get('query', path)!r}: "
                                         f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def _time_param(self, t: float) -> str:
        """Monitor time ``t`` as the Unix timestamp Prometheus reads, in whole ms."""
        ms = self.origin_s * 1000 + round(t * 1000)
        return f"{ms // 1000}.{ms % 1000:03d}"

    def _t(self, timestamp) -> float:
        """A Unix timestamp from the API (a Decimal) as monitor time."""
        return (int(Decimal(timestamp) * 1000) - self.origin_s * 1000) / 1000

    def query(self, expr: str, at: float | None = None) -> QueryResult:
        """PromQL ``expr`` evaluated at ``at`` (monitor time; default now) by Prometheus:
        ``{labels: value}`` for an instant vector (a scalar as ``{(): value}``),
        ``{labels: [Sample, ...]}`` for a range selector."""
        params = {"query": expr}
        if at is not None:
            params["time"] = self._time_param(at)
        data = self._api("/api/v1/query", **params)
        kind, result = data["resultType"], data["result"]
        if kind == "scalar":
            return {(): float(result[1])}
        if kind == "vector":
            return {_labels(item["metric"]): float(item["value"][1]) for item in result}
        if kind == "matrix":
            return {_labels(item["metric"]): [Sample(self._t(t), float(v))
                                              for t, v in item["values"]] for item in result}
        raise ParameterError("expr", f"expr {expr!r} returned a {kind}, not a number or vector")

    def query_range(self, expr: str, start: float, end: float, step: float) -> RangeVector:
        """``expr`` evaluated at ``start``, ``start + step``, ... up to ``end`` (monitor
        time): ``/api/v1/query_range``."""
        _check_range(start, end, step)
        data = self._api("/api/v1/query_range", query=expr, start=self._time_param(start),
                         end=self._time_param(end), step=f"{step:g}")
        return {_labels(item["metric"]): [Sample(self._t(t), float(v))
                                          for t, v in item["values"]]
                for item in data["result"]}

    def alerts(self) -> list[ActiveAlert]:
        """The pending and firing alerts, from ``/api/v1/alerts``."""
        out = []
        for alert in self._api("/api/v1/alerts")["alerts"]:
            labels = dict(alert["labels"])
            name = labels.pop("alertname")
            out.append(ActiveAlert(name, labels_of(labels), alert["state"],
                                   rfc3339_s(alert["activeAt"]) - self.origin_s,
                                   float(alert["value"])))
        return sorted(out, key=lambda a: (a.name, a.labels))


def _labels(metric: dict) -> Labels:
    return labels_of({k: v for k, v in metric.items() if k != "__name__"})


def rfc3339_s(text: str) -> float:
    """``2026-12-01T10:00:00.123456789Z`` (Go's RFC 3339 with nanoseconds, as Prometheus'
    API writes ``activeAt``) as Unix seconds."""
    match = re.fullmatch(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)",
                         text)
    if match is None:
        raise ParameterError("activeAt", f"activeAt must be an RFC 3339 time, got {text!r}")
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    seconds = calendar.timegm((year, month, day, hour, minute, second)) + float(match[7] or 0)
    if match[8] != "Z":
        sign = 1 if match[8][0] == "+" else -1
        seconds -= sign * (int(match[8][1:3]) * 3600 + int(match[8][4:6]) * 60)
    return seconds


def _check_range(start: float, end: float, step: float) -> None:
    in_range("start", start)
    in_range("end", end, start)
    in_range("step", step, 0, low_open=True)


def _seconds(window_s: float) -> str:
    """A PromQL duration in whole milliseconds (``3s``, ``2500ms``)."""
    ms = max(1, round(window_s * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


# -- the fallback: labkit.monitor's own scraper --------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_MATCHERS = r"(?:\{(?P<matchers>[^}]*)\})?"
_WINDOW = r"\[(?P<window>\d+(?:ms|s|m|h))\]"
_BY = r"(?:\s*by\s*\((?P<by>[^)]*)\))?"

#: The PromQL shapes :class:`LabkitMonitor` evaluates, with the labkit function behind each;
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


class LabkitMonitor(Monitor):
    """labkit.monitor's scraper in Prometheus' place (chapter 8): the same targets, jobs
    (``vllm``, ``labkit-gateway``), interval, timeout and rules, a scrape of every target
    then an evaluation of every rule each ``scrape_interval_s``.

    The scraper runs on its own asyncio loop in a daemon thread; :meth:`query` and
    :meth:`alerts` run on that loop too, between two scrapes' writes, so the store is never
    read half-updated and needs no lock.
    """

    def __init__(self, vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                 rules: Sequence[AlertRule] = (), *, scrape_interval_s: float = 1.0,
                 reason: str = f"Prometheus not installed: {INSTALL_HINT}") -> None:
        super().__init__(vllm_urls, gateway_urls, rules, scrape_interval_s=scrape_interval_s)
        self.which = f"labkit.monitor's scraper ({reason})"
        self.store = SeriesStore()
        self.evaluator = RuleEvaluator(self.rules, self.store)
        self.rounds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> LabkitMonitor:
        """Start scraping in a background thread; returns once the loop runs."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                        name="labkit-monitor")
        self._thread.start()
        ready.wait()
        return self

    def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        ready.set()
        try:
            self._loop.run_until_complete(self._scrape_loop())
        except BaseException as error:  # kept for the caller: a thread's error is silent
            self._error = error
        finally:
            self._loop.close()

    async def _scrape_loop(self) -> None:
        timeout_s = min(DEFAULT_SCRAPE_TIMEOUT_S, self.scrape_interval_s)  # as scrape_config
        async with httpx.AsyncClient(trust_env=False) as client:
            scrapers = [Scraper(urls, client, store=self.store, job=job, timeout_s=timeout_s,
                                clock=self.now)
                        for job, urls in (("vllm", self.vllm_urls),
                                          ("labkit-gateway", self.gateway_urls)) if urls]
            while not self._stop.is_set():
                started = time.monotonic()
                await asyncio.gather(*(s.scrape_once() for s in scrapers))
                self.evaluator.evaluate(self.now())
                self.rounds += 1
                try:
                    await asyncio.wait_for(self._stop.wait(), max(
                        0.0, self.scrape_interval_s - (time.monotonic() - started)))
                except TimeoutError:
                    pass

    def stop(self) -> None:
        """Stop scraping and end the thread."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self._thread = None

    def _on_loop(self, fn: Callable[[], object]):
        """Run ``fn`` on the scraper's loop, between scrapes, and return its result."""
        if self._error is not None:
            raise RuntimeError(f"the scraper stopped: {self._error!r}") from self._error
        if self._thread is None:
            raise RuntimeError("the monitor is not running: start() it first")

        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=30)

    def query(self, expr: str, at: float | None = None) -> QueryResult:
        """``expr`` (one of :data:`~labkit.monitor.prometheus.SUPPORTED_QUERIES`) at ``at``
        (monitor time; default now), on the scraped samples."""
        return self._on_loop(lambda: evaluate(self.store, expr,
                                              self.now() if at is None else at))

    def query_range(self, expr: str, start: float, end: float, step: float) -> RangeVector:
        """``expr`` evaluated at ``start``, ``start + step``, ... up to ``end``, as
        Prometheus' ``query_range`` (steps where a series has no value are left out)."""
        _check_range(start, end, step)
        steps = [start + k * step for k in range(math.floor((end - start) / step + 1e-9) + 1)]

        def run() -> RangeVector:
            out: RangeVector = {}
            for t in steps:
                result = evaluate(self.store, expr, t)
                if result and isinstance(next(iter(result.values())), list):
                    raise ParameterError("expr", f"expr {expr!r} is a range selector: "
                                                 f"query_range needs an instant vector")
                for labels, value in result.items():
                    out.setdefault(labels, []).append(Sample(t, value))
            return out

        return self._on_loop(run)

    def alerts(self) -> list[ActiveAlert]:
        """The pending and firing alerts of ``evaluator``, the monitor's
        :class:`~labkit.monitor.alerts.RuleEvaluator`."""
        def active() -> list[ActiveAlert]:
            return sorted((ActiveAlert(a.rule, a.labels, a.state.value, a.active_at_s, a.value)
                           for a in self.evaluator.alerts()
                           if a.state is not AlertState.INACTIVE),
                          key=lambda a: (a.name, a.labels))

        return self._on_loop(active)


def start_monitor(vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                  rules: Sequence[AlertRule] = (), *,
                  scrape_interval_s: float = 1.0) -> Monitor:
    """Prometheus scraping ``vllm_urls`` and ``gateway_urls`` when it is installed, else
    labkit.monitor's scraper, started (chapter 8). Its ``which`` says which one runs."""
    if prometheus_binary() is not None:
        return PrometheusServer(vllm_urls, gateway_urls, rules,
                                scrape_interval_s=scrape_interval_s).start()
    reason = (f"Prometheus hidden by {PROMETHEUS_ENV}=off" if shutil.which("prometheus")
              else f"Prometheus not installed: {INSTALL_HINT}")
    return LabkitMonitor(vllm_urls, gateway_urls, rules, scrape_interval_s=scrape_interval_s,
                         reason=reason).start()


# -- alert transitions, as an operator would see them -------------------------------------


@dataclass(frozen=True)
class AlertChange:
    """An alert entering a state at ``t_s`` (monitor time), as seen by polling the active
    alerts: ``pending``, ``firing``, ``resolved`` (firing, then gone) or ``inactive``
    (pending, then gone: the condition stopped before ``for:`` elapsed)."""

    t_s: float
    name: str
    labels: Labels
    state: str
    active_at_s: float


class AlertWatcher:
    """Polls ``monitor.alerts()`` and records every change (chapter 8). Prometheus' API
    lists only pending and firing alerts: an alert that leaves the list was resolved (if it
    fired) or dropped (if it was pending)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.changes: list[AlertChange] = []
        self._last: dict[tuple[str, Labels], ActiveAlert] = {}

    @property
    def active(self) -> list[ActiveAlert]:
        """The alerts pending or firing at the last poll."""
        return list(self._last.values())

    def poll(self) -> list[AlertChange]:
        """Read the active alerts once; returns (and records) the changes since last time.

        An alert seen firing and now pending (or active since a later time) is a new alert
        for the same labels: the old one resolved between two polls, which is recorded
        before the new one's state."""
        t_s = self.monitor.now()
        now = {(a.name, a.labels): a for a in self.monitor.alerts()}
        changes = []

        def ended(alert: ActiveAlert) -> AlertChange:
            state = "resolved" if alert.state == "firing" else "inactive"
            return AlertChange(t_s, alert.name, alert.labels, state, alert.active_at_s)

        for key, alert in now.items():
            before = self._last.get(key)
            if before is not None and (before.active_at_s != alert.active_at_s
                                       or (before.state, alert.state) == ("firing", "pending")):
                changes.append(ended(before))
                before = None
            if before is None or before.state != alert.state:
                changes.append(AlertChange(t_s, alert.name, alert.labels, alert.state,
                                           alert.active_at_s))
        changes += [ended(alert) for key, alert in self._last.items() if key not in now]
        self._last = now
        self.changes += changes
        return changes

    def states(self, name: str) -> list[str]:
        """The states rule ``name``'s alerts went through, in order."""
        return [c.state for c in self.changes if c.name == name]
