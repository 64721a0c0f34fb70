"""The real Prometheus on loopback for a lab or a test (:ref:`ch08-scraping`).

:class:`PrometheusServer` runs the ``prometheus`` binary (Debian's package, 2.42) with the
scrape config and rules file of :mod:`labkit.monitor.artifacts`, a scrape and rule
evaluation every second, its storage in a temporary directory, listening on a free port of
127.0.0.1, started and stopped as every labkit server is
(:class:`labkit.process.ServerProcess`, ready when ``/-/ready`` answers: its TSDB open and
the config loaded). PromQL goes to its HTTP API (``/api/v1/query``, ``/api/v1/query_range``,
``/api/v1/alerts``; prometheus/prometheus v2.42.0, ``web/api/v1/api.go``). Where the binary
is absent, :func:`~labkit.monitor.fallback.start_monitor` runs
:class:`~labkit.monitor.fallback.LabkitMonitor` behind the same
:class:`~labkit.monitor.base.Monitor` interface.

Prometheus applies a new config's targets through its discovery manager, which sends updates
every 5 seconds (``updatert``, v2.42.0 ``discovery/manager.go``): the first scrapes come a few
seconds after ``/-/ready``, hence ``wait_scraped()``. ``/api/v1/alerts`` lists the
alerts that are pending or firing (``ActiveAlerts``, v2.42.0 ``rules/alerting.go``): a
resolved alert leaves the list, which :class:`~labkit.monitor.alert_watcher.AlertWatcher`
records as ``resolved``.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from decimal import Decimal

import httpx

from labkit.checks import ParameterError, in_range
from labkit.monitor.alerts import AlertRule
from labkit.monitor.artifacts import rules_file, scrape_config
from labkit.monitor.base import ActiveAlert, Monitor, QueryResult, RangeVector
from labkit.monitor.series import Labels, Sample, labels_of
from labkit.process import ServerProcess, free_port

#: Set to ``off`` to hide the ``prometheus`` binary, so that the fallback runs (the tests
#: and the lab's nbval run use it to check both paths).
PROMETHEUS_ENV = "LABKIT_PROMETHEUS"

#: How to get the binary, for the banner and the error messages.
INSTALL_HINT = "apt-get install prometheus"


def prometheus_binary() -> str | None:
    """The ``prometheus`` executable on ``PATH``, or ``None`` when there is none or
    ``LABKIT_PROMETHEUS=off`` hides it."""
    if os.environ.get(PROMETHEUS_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    return shutil.which("prometheus")


class PrometheusServer(Monitor):
    """``prometheus`` scraping the targets every ``scrape_interval_s`` and evaluating
    ``rules`` as often, on a free loopback port with a throwaway storage directory
    (chapter 8).

    A :class:`~labkit.process.ServerProcess` like every server a lab starts: its own process
    group, stopped as a whole (SIGTERM, then SIGKILL), and on Linux asked to die with the
    process that started it, so a killed kernel leaves no Prometheus behind.
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
        self._server = ServerProcess(self.command(self._folder.name), self.base_url,
                                     self.startup_timeout_s, ready_path="/-/ready")
        try:
            self._server.start()
        except (RuntimeError, TimeoutError):
            self.stop()
            raise
        self.version = self._api("/api/v1/status/buildinfo")["version"]
        self.which = f"Prometheus {self.version} at 127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        """Stop Prometheus (SIGTERM to its process group), delete its storage and close
        the HTTP client."""
        if self._server is not None:
            self._server.stop(grace_s=10)
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
        self._check_range(start, end, step)
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

