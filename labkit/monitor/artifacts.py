"""Production monitoring artifacts for a vLLM fleet: scrape config, alert rules and their unit
tests, a Grafana dashboard (:ref:`ch08-alerts`, :ref:`ch08-scraping`).

Everything is built as plain dicts, written as YAML or JSON, and checked by the tool that
will read it (:func:`promtool`): ``promtool check config`` for the scrape config,
``promtool check rules`` for the rules and for every dashboard expression (wrapped as
recording rules), ``promtool test rules`` for the alert unit tests (prometheus/prometheus,
``cmd/promtool``; Debian's ``prometheus`` 2.42 package ships it).

The alert unit tests come from a scripted load (:func:`overload_script`): calm, then an
overload (a long queue, a full KV cache, preemptions, slow first tokens, 5xx answers at the
gateway, one server down), then calm again. :func:`rule_tests` replays the script through
:class:`~labkit.monitor.alerts.RuleEvaluator`, requires every rule to fire after its ``for:``
and resolve, and writes what it saw as ``promtool`` test cases, so Prometheus checks that
its own rule engine agrees with labkit's, step by step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.metrics import TTFT_BUCKETS
from labkit.http.urls import instance_of
from labkit.monitor.alerts import AlertRule, AlertState, RuleEvaluator
from labkit.monitor.scrape import DEFAULT_SCRAPE_INTERVAL_S, DEFAULT_SCRAPE_TIMEOUT_S
from labkit.monitor.series import SeriesStore
from labkit.units import prometheus_duration

#: Grafana's classic dashboard JSON model, schema version of Grafana 12.x exports
#: (grafana/grafana, docs/sources/visualizations/dashboards/build-dashboards/
#: view-dashboard-json-model/index.md, commit 11835de, 2025-12: ``"schemaVersion": 42``).
GRAFANA_SCHEMA_VERSION = 42


# -- scrape config --------------------------------------------------------------------------


def scrape_config(vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (), *,
                  scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
                  evaluation_interval_s: float | None = None,
                  rule_files: Sequence[str] = ()) -> dict:
    """A ``prometheus.yml`` scraping ``vllm_urls`` (``labkit serve`` or vLLM, job
    ``vllm``) and ``gateway_urls`` (the chapter 5 gateway, job ``labkit-gateway``), chapter 8.

    The timeout is Prometheus' default 10 s, or the interval when that is shorter (Prometheus
    rejects a timeout above the interval); rules are evaluated as often as targets are
    scraped unless ``evaluation_interval_s`` says otherwise.
    """
    if not vllm_urls:
        raise ParameterError("vllm_urls", "vllm_urls must name at least one server")
    in_range("scrape_interval_s", scrape_interval_s, 0, low_open=True)
    evaluation = scrape_interval_s if evaluation_interval_s is None else evaluation_interval_s
    in_range("evaluation_interval_s", evaluation, 0, low_open=True)

    def job(name: str, urls: Sequence[str]) -> dict:
        return {"job_name": name, "metrics_path": "/metrics",
                "static_configs": [{"targets": [instance_of(u) for u in urls]}]}

    config = {"global": {
        "scrape_interval": prometheus_duration(scrape_interval_s, "scrape_interval_s"),
        "scrape_timeout": prometheus_duration(min(DEFAULT_SCRAPE_TIMEOUT_S, scrape_interval_s),
                                              "scrape_interval_s"),
        "evaluation_interval": prometheus_duration(evaluation, "evaluation_interval_s")},
              "scrape_configs": [job("vllm", vllm_urls)]}
    if gateway_urls:
        config["scrape_configs"].append(job("labkit-gateway", gateway_urls))
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


# -- alert rules and their unit tests ------------------------------------------------------


def rules_file(rules: Sequence[AlertRule], *, group: str = "labkit-vllm",
               interval_s: float | None = None) -> dict:
    """A Prometheus rules file with one alerting rule per :class:`AlertRule`: its PromQL,
    ``for:``, ``keep_firing_for:`` and summary (chapter 8)."""
    if not rules:
        raise ParameterError("rules", "rules must hold at least one AlertRule")
    out = []
    for rule in rules:
        entry = {"alert": rule.name, "expr": rule.promql,
                 "for": prometheus_duration(rule.for_s, "for_s")}
        if rule.keep_firing_for_s:
            entry["keep_firing_for"] = prometheus_duration(rule.keep_firing_for_s,
                                                           "keep_firing_for_s")
        if rule.summary:
            entry["annotations"] = {"summary": rule.summary}
        out.append(entry)
    body = {"name": group, "rules": out}
    if interval_s is not None:
        in_range("interval_s", interval_s, 0, low_open=True)
        body["interval"] = prometheus_duration(interval_s, "interval_s")
    return {"groups": [body]}


@dataclass(frozen=True)
class ScriptedLoad:
    """Series sampled every ``interval_s`` from t = 0: ``{(name, labels): values}``, with
    ``None`` where a series has no sample (a server that does not answer)."""

    interval_s: float
    steps: int
    series: Mapping[tuple[str, tuple[tuple[str, str], ...]], Sequence[float | None]]

    def store(self) -> SeriesStore:
        """The script as scraped samples, for :class:`~labkit.monitor.RuleEvaluator`."""
        store = SeriesStore()
        for (name, labels), values in self.series.items():
            for step, value in enumerate(values):
                if value is not None:
                    store.add(name, dict(labels), step * self.interval_s, value)
        return store

    def promtool_series(self) -> list[dict]:
        """The script as ``promtool test rules`` ``input_series`` (``_``: no sample)."""
        out = []
        for (name, labels), values in self.series.items():
            selector = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
            out.append({"series": selector,
                        "values": " ".join("_" if v is None else f"{v:g}" for v in values)})
        return out


def overload_script(busy: str = "127.0.0.1:8001", crashing: str = "127.0.0.1:8002", *,
                    interval_s: float = 13.0, calm_steps: int = 30, overload_steps: int = 30,
                    recovery_steps: int = 40) -> ScriptedLoad:
    """Two vLLM servers and a gateway through calm, overload and calm again (chapter 8).

    During the overload ``busy`` has 50 requests waiting, a full KV cache, 5 preemptions and
    10 first tokens at 5 s per step (calm: none waiting, 10 % KV, 10 first tokens under
    0.1 s); the gateway answers half its requests to ``busy`` with 503; ``crashing`` stops
    answering (``up`` 0, no samples). The 13-second default interval is ours: no
    whole-minute rate window starts exactly on a sample, where Prometheus 2.x (closed
    window) and 3.x and labkit (left-open) would disagree by one step.
    """
    positive_int("calm_steps", calm_steps)
    positive_int("overload_steps", overload_steps)
    positive_int("recovery_steps", recovery_steps)
    in_range("interval_s", interval_s, 0, low_open=True)
    steps = calm_steps + overload_steps + recovery_steps
    hot = [calm_steps <= k < calm_steps + overload_steps for k in range(steps)]

    def level(calm: float, over: float) -> list[float]:
        return [over if h else calm for h in hot]

    def counter(calm: float, over: float) -> list[float]:
        total, out = 0.0, []
        for k in range(steps):
            total += (over if hot[k] else calm) if k else 0.0
            out.append(total)
        return out

    def vllm(instance: str, **extra: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"instance": instance, "job": "vllm", **extra}.items()))

    series: dict = {
        ("vllm:num_requests_waiting", vllm(busy)): level(0, 50),
        ("vllm:kv_cache_usage_perc", vllm(busy)): level(0.1, 1.0),
        ("vllm:num_preemptions_total", vllm(busy)): counter(0, 5),
        ("up", vllm(busy)): level(1, 1),
        ("up", vllm(crashing)): level(1, 0),
        ("vllm:num_requests_waiting", vllm(crashing)): [None if h else 0.0 for h in hot],
    }
    for edge in (*TTFT_BUCKETS, float("inf")):
        le = "+Inf" if edge == float("inf") else repr(edge)
        series[("vllm:time_to_first_token_seconds_bucket", vllm(busy, le=le))] = counter(
            10 if edge >= 0.1 else 0, 10 if edge >= 5.0 else 0)
    gateway = {"instance": "127.0.0.1:8080", "job": "labkit-gateway", "backend": busy}
    for status, calm, over in (("200", 10, 10), ("503", 0, 10)):
        labels = tuple(sorted({**gateway, "status": status}.items()))
        series[("labkit_gateway_requests_total", labels)] = counter(calm, over)
    return ScriptedLoad(interval_s, steps, series)


def rule_tests(rules: Sequence[AlertRule], script: ScriptedLoad, *,
               rule_file: str = "rules.yml") -> dict:
    """A ``promtool test rules`` file for ``rules`` on ``script`` (chapter 8).

    The script is evaluated with :class:`~labkit.monitor.RuleEvaluator` at every step; each rule
    must fire (after its ``for:``) and be resolved by the end, else ``ParameterError``: a test in
    which an alert never fires proves nothing. Test cases are written where a rule's firing alerts
    change and one step before (still pending or still firing), with the labels and summary
    Prometheus must report.
    """
    interval = prometheus_duration(script.interval_s, "script.interval_s")
    evaluator = RuleEvaluator(rules, script.store())
    firing: dict[str, list[list[dict]]] = {r.name: [] for r in rules}
    for step in range(script.steps):
        evaluator.evaluate(step * script.interval_s)
        for rule in rules:
            firing[rule.name].append(sorted(
                (dict(a.labels) for a in evaluator.alerts(AlertState.FIRING)
                 if a.rule == rule.name), key=lambda labels: sorted(labels.items())))
    cases = []
    for rule in rules:
        timeline = firing[rule.name]
        changes = [k for k in range(1, script.steps) if timeline[k] != timeline[k - 1]]
        if not changes or timeline[-1]:
            raise ParameterError("script", f"script must make {rule.name} fire and resolve; "
                                           f"it {'never fires' if not changes else 'ends firing'}")
        for step in sorted({s for k in changes for s in (k - 1, k)}):
            expected = [{"exp_labels": labels} for labels in timeline[step]]
            if rule.summary:
                for alert in expected:
                    alert["exp_annotations"] = {"summary": rule.summary}
            cases.append({"eval_time": prometheus_duration(step * script.interval_s,
                                                           "script.interval_s"),
                          "alertname": rule.name, "exp_alerts": expected})
    return {"rule_files": [rule_file],
            "evaluation_interval": interval,
            "tests": [{"interval": interval,
                       "input_series": script.promtool_series(),
                       "alert_rule_test": cases}]}


# -- Grafana dashboard ----------------------------------------------------------------------

_RATE = "$__rate_interval"


def _panels(window: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(legend, PromQL)]) for each panel, on vLLM's metric names."""

    def quantile(q: float, histogram: str) -> str:
        return (f"histogram_quantile({q:g}, sum by (le, instance) "
                f"(rate({histogram}_bucket[{window}])))")

    per_instance = "sum by (instance) ({})"
    return [
        ("Requests finished per second", "reqps",
         [("{{instance}} {{finished_reason}}", "sum by (instance, finished_reason) "
           f"(rate(vllm:request_success_total[{window}]))")]),
        ("Time to first token", "s",
         [("p50 {{instance}}", quantile(0.5, "vllm:time_to_first_token_seconds")),
          ("p99 {{instance}}", quantile(0.99, "vllm:time_to_first_token_seconds"))]),
        ("Inter-token latency", "s",
         [("p50 {{instance}}", quantile(0.5, "vllm:inter_token_latency_seconds")),
          ("p99 {{instance}}", quantile(0.99, "vllm:inter_token_latency_seconds"))]),
        ("Requests running and waiting", "short",
         [("running {{instance}}", per_instance.format("vllm:num_requests_running")),
          ("waiting {{instance}}", per_instance.format("vllm:num_requests_waiting"))]),
        ("KV-cache usage", "percentunit",
         [("{{instance}}", per_instance.format("vllm:kv_cache_usage_perc"))]),
        ("Prefix-cache hit rate", "percentunit",
         [("{{instance}}", f"sum by (instance) (rate(vllm:prefix_cache_hits_total[{window}]))"
           f" / sum by (instance) (rate(vllm:prefix_cache_queries_total[{window}]))")]),
        ("Preemptions per second", "short",
         [("{{instance}}", f"sum by (instance) (rate(vllm:num_preemptions_total[{window}]))")]),
        ("Tokens per second", "short",
         [("prompt {{instance}}",
           f"sum by (instance) (rate(vllm:prompt_tokens_total[{window}]))"),
          ("generated {{instance}}",
           f"sum by (instance) (rate(vllm:generation_tokens_total[{window}]))")]),
    ]


def dashboard(*, title: str = "vLLM fleet (labkit, chapter 8)", uid: str = "labkit-vllm",
              rate_window: str = _RATE, refresh: str = "10s") -> dict:
    """A Grafana dashboard (classic JSON model) of vLLM's metrics, chapter 8.

    Fields as Grafana's JSON model documents them (see ``GRAFANA_SCHEMA_VERSION``):
    ``uid``, ``title``, ``schemaVersion``, ``time``, ``refresh``, a ``templating`` variable
    for the Prometheus data source, and ``timeseries`` panels with ``id``, ``gridPos`` (24
    columns wide), ``datasource``, ``fieldConfig`` (unit) and ``targets`` (``refId``,
    ``expr``, ``legendFormat``). ``$__rate_interval`` is Grafana's recommended range for
    ``rate()`` (at least four scrape intervals).
    """
    if not 8 <= len(uid) <= 40:
        raise ParameterError("uid", f"uid must be 8 to 40 characters (Grafana's JSON model), "
                                    f"got {uid!r}")
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for index, (panel_title, unit, queries) in enumerate(_panels(rate_window)):
        panels.append({
            "id": index + 1, "type": "timeseries", "title": panel_title,
            "datasource": datasource,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + k), "datasource": datasource, "expr": expr,
                         "legendFormat": legend} for k, (legend, expr) in enumerate(queries)],
        })
    return {
        "uid": uid, "title": title, "tags": ["vllm", "labkit"], "timezone": "browser",
        "editable": True, "graphTooltip": 1, "schemaVersion": GRAFANA_SCHEMA_VERSION,
        "version": 1, "refresh": refresh, "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [{"name": "datasource", "label": "Prometheus",
                                 "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def panel_queries(board: Mapping) -> dict[str, str]:
    """``{"<panel title> / <refId>": expr}`` for every target of ``board``."""
    return {f"{p['title']} / {t['refId']}": t["expr"]
            for p in board["panels"] for t in p["targets"]}


def recording_rules(queries: Mapping[str, str], *, rate_window: str = "5m") -> dict:
    """``queries`` as a throwaway recording-rules file, so that ``promtool check rules``
    parses each one; Grafana's ``$__rate_interval`` becomes ``rate_window``."""
    return {"groups": [{"name": "labkit-dashboard-check", "rules": [
        {"record": f"labkit:dashboard_query_{k}", "expr": expr.replace(_RATE, rate_window)}
        for k, expr in enumerate(queries.values())]}]}


# -- promtool -------------------------------------------------------------------------------


def promtool(command: Sequence[str], files: Mapping[str, object], *,
             timeout_s: float = 60.0) -> str:
    """Write ``files`` (``{name: dict}``, as YAML) to a temporary directory and run
    ``promtool <command...> <names>`` there; return its output, or raise
    ``ParameterError`` with promtool's message when it rejects them (chapter 8).

    ``command`` is e.g. ``["check", "rules"]``; the first file name is the argument when
    the command takes one file (``check config``, ``test rules``).
    """
    import yaml  # the ``gateway`` extra; only needed to write the files

    exe = shutil.which("promtool")
    if exe is None:
        raise FileNotFoundError("promtool is not installed (Debian/Ubuntu: apt-get install "
                                "prometheus; elsewhere: prometheus.io/download)")
    with tempfile.TemporaryDirectory() as folder:
        for name, body in files.items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                yaml.safe_dump(body, f, sort_keys=False)
        args = list(files)[:1] if command[0] == "test" or command[-1] == "config" \
            else list(files)
        done = subprocess.run([exe, *command, *args], cwd=folder, capture_output=True,
                              text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise ParameterError(" ".join(command), f"promtool {' '.join(command)} failed:\n"
                                                f"{output}")
    return output

