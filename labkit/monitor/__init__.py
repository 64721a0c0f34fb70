"""Monitoring inference servers: scrape, compute like PromQL, alert, check health
(chapter 8: :ref:`ch08-health-checks` to :ref:`ch08-scraping`).

* :mod:`labkit.monitor.series`: scraped samples over time, ``rate()``, ``increase()`` and
  ``histogram_quantile()`` with PromQL's exact math;
* :mod:`labkit.monitor.scrape`: async scraping of any number of ``/metrics`` pages;
* :mod:`labkit.monitor.alerts`: alerting rules with ``for:``, pending/firing/resolved;
* :mod:`labkit.monitor.health`: ``/health`` probes with consecutive-failure state;
* :mod:`labkit.monitor.artifacts`: scrape config, rules, rule unit tests, Grafana dashboard;
* :mod:`labkit.monitor.conformance`: ``/metrics`` against vLLM's metric table, query lint;
* :mod:`labkit.monitor.prometheus`: the real Prometheus on loopback, queried over its HTTP API,
  or labkit's own scraper behind the same interface where Prometheus is not installed;
* :mod:`labkit.monitor.live_dashboard`: a notebook dashboard that redraws while a load runs.
"""

from labkit.monitor.alerts import (Alert, AlertEvent, AlertRule, AlertState, RuleEvaluator,
                                   backend_down, error_ratio_above, kv_usage_above,
                                   preemption_rate_above, ttft_p99_above, waiting_queue_above)
from labkit.monitor.artifacts import (dashboard, overload_script, promtool, rule_tests,
                                      rules_file, scrape_config)
from labkit.monitor.conformance import check_exposition, lint_queries, load_reference
from labkit.monitor.health import HealthChecker, HealthStatus, HealthTransition
from labkit.monitor.live_dashboard import (LiveDashboard, LoadPhase, Panel, default_panels,
                                           scripted_load)
from labkit.monitor.prometheus import (ActiveAlert, AlertChange, AlertWatcher, LabkitMonitor,
                                       Monitor, PrometheusServer, UnsupportedQuery,
                                       prometheus_binary, start_monitor)
from labkit.monitor.scrape import ScrapeResult, Scraper, parse_samples
from labkit.monitor.series import (Sample, Series, SeriesStore, bucket_quantile,
                                   extrapolated_delta, histogram_quantile, increase,
                                   latest_values, rate, sum_rate)

__all__ = [
    "check_exposition", "dashboard", "lint_queries", "load_reference", "overload_script",
    "promtool", "rule_tests", "rules_file", "scrape_config",
    "Alert", "AlertEvent", "AlertRule", "AlertState", "HealthChecker", "HealthStatus",
    "HealthTransition", "RuleEvaluator", "Sample", "ScrapeResult", "Scraper", "Series",
    "SeriesStore", "backend_down", "bucket_quantile", "error_ratio_above",
    "extrapolated_delta", "histogram_quantile", "increase", "kv_usage_above",
    "latest_values", "parse_samples", "preemption_rate_above", "rate", "sum_rate",
    "ttft_p99_above", "waiting_queue_above",
    "ActiveAlert", "AlertChange", "AlertWatcher", "LabkitMonitor", "LiveDashboard", "LoadPhase",
    "Monitor", "Panel", "PrometheusServer", "UnsupportedQuery", "default_panels",
    "prometheus_binary", "scripted_load", "start_monitor",
]
