"""Monitoring inference servers: scrape, compute like PromQL, alert, check health (chapter 8).

* :mod:`labkit.monitor.series`: scraped samples over time, ``rate()``, ``increase()`` and
  ``histogram_quantile()`` with PromQL's exact math;
* :mod:`labkit.monitor.scrape`: async scraping of any number of ``/metrics`` pages;
* :mod:`labkit.monitor.alerts`: alerting rules with ``for:``, pending/firing/resolved;
* :mod:`labkit.monitor.health`: ``/health`` probes with consecutive-failure state;
* :mod:`labkit.monitor.artifacts`: scrape config, rules, rule unit tests, Grafana dashboard;
* :mod:`labkit.monitor.conformance`: ``/metrics`` against vLLM's metric table, query lint.
"""

from labkit.monitor.alerts import (Alert, AlertEvent, AlertRule, AlertState, RuleEvaluator,
                                   backend_down, error_ratio_above, kv_usage_above,
                                   preemption_rate_above, ttft_p99_above, waiting_queue_above)
from labkit.monitor.artifacts import (dashboard, overload_script, promtool, rule_tests,
                                      rules_file, scrape_config)
from labkit.monitor.conformance import check_exposition, lint_queries, load_reference
from labkit.monitor.health import HealthChecker, HealthStatus, HealthTransition
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
]
