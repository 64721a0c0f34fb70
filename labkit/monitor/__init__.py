"""Monitoring inference servers: scrape, compute like PromQL, alert, check health
(chapter 8: :ref:`ch08-health-checks` to :ref:`ch08-scraping`).

* :mod:`labkit.monitor.series`: scraped samples over time, ``rate()``, ``increase()`` and
  ``histogram_quantile()`` with PromQL's exact math;
* :mod:`labkit.monitor.scrape`: async scraping of any number of ``/metrics`` pages;
* :mod:`labkit.monitor.alerts`: alerting rules with ``for:``, pending/firing/resolved;
* :mod:`labkit.monitor.health`: ``/health`` probes with consecutive-failure state;
* :mod:`labkit.monitor.artifacts`: scrape config, rules, rule unit tests, Grafana dashboard;
* :mod:`labkit.monitor.conformance`: ``/metrics`` against vLLM's metric table, query lint;
* :mod:`labkit.monitor.base`: what a monitor answers (PromQL, alerts, its clock), whichever runs;
* :mod:`labkit.monitor.prometheus`: the real Prometheus on loopback, queried over its HTTP API;
* :mod:`labkit.monitor.promql`: the PromQL shapes labkit evaluates itself;
* :mod:`labkit.monitor.fallback`: labkit's scraper behind the same interface where Prometheus
  is not installed, and :func:`start_monitor`, which picks;
* :mod:`labkit.monitor.alert_watcher`: alert state changes, seen by polling a monitor;
* :mod:`labkit.monitor.live_dashboard`: a notebook dashboard that redraws while a load runs.
"""

from labkit.monitor.alert_watcher import AlertChange, AlertWatcher
from labkit.monitor.alerts import (Alert, AlertEvent, AlertRule, AlertState, RuleEvaluator,
                                   backend_down, error_ratio_above, kv_usage_above,
                                   preemption_rate_above, ttft_p99_above, waiting_queue_above)
from labkit.monitor.artifacts import (dashboard, overload_script, promtool, rule_tests, rules_file,
                                      scrape_config)
from labkit.monitor.base import ActiveAlert, Monitor
from labkit.monitor.conformance import check_exposition, lint_queries, load_reference
from labkit.monitor.fallback import LabkitMonitor, start_monitor
from labkit.monitor.health import HealthChecker, HealthStatus, HealthTransition
from labkit.monitor.live_dashboard import LiveDashboard, Panel, default_panels
from labkit.monitor.prometheus import PrometheusServer, prometheus_binary
from labkit.monitor.promql import UnsupportedQuery
from labkit.monitor.scrape import Scraper, ScrapeResult
from labkit.monitor.series import (Sample, Series, SeriesStore, bucket_quantile, extrapolated_delta,
                                   histogram_quantile, increase, latest_values, rate, sum_rate)

__all__ = [
    "check_exposition", "dashboard", "lint_queries", "load_reference", "overload_script",
    "promtool", "rule_tests", "rules_file", "scrape_config",
    "Alert", "AlertEvent", "AlertRule", "AlertState", "HealthChecker", "HealthStatus",
    "HealthTransition", "RuleEvaluator", "Sample", "ScrapeResult", "Scraper", "Series",
    "SeriesStore", "backend_down", "bucket_quantile", "error_ratio_above",
    "extrapolated_delta", "histogram_quantile", "increase", "kv_usage_above",
    "latest_values", "preemption_rate_above", "rate", "sum_rate",
    "ttft_p99_above", "waiting_queue_above",
    "ActiveAlert", "AlertChange", "AlertWatcher", "LabkitMonitor", "LiveDashboard", "Monitor",
    "Panel", "PrometheusServer", "UnsupportedQuery", "default_panels", "prometheus_binary",
    "start_monitor",
]
