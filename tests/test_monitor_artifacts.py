"""labkit.monitor.artifacts (chapter 8): the scrape config, the alert rules, their unit tests
and the dashboard's expressions, each checked by Prometheus' own ``promtool``."""

import json
import shutil

import pytest

from labkit.checks import ParameterError
from labkit.monitor import (backend_down, error_ratio_above, kv_usage_above,
                            preemption_rate_above, ttft_p99_above, waiting_queue_above)
from labkit.monitor.artifacts import (GRAFANA_SCHEMA_VERSION, dashboard, overload_script,
                                      panel_queries, promtool, recording_rules, rule_tests,
                                      rules_file, scrape_config)
from labkit.monitor.conformance import lint_queries
from labkit.units import prometheus_duration

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (apt-get install prometheus; `make test` installs it)")

FOR_S = 60.0


def chapter_rules():
    return [ttft_p99_above(2.0, for_s=FOR_S), waiting_queue_above(10, for_s=FOR_S),
            kv_usage_above(0.9, for_s=FOR_S), preemption_rate_above(0.1, for_s=FOR_S),
            error_ratio_above(0.2, for_s=FOR_S), backend_down(for_s=FOR_S)]


def seconds(duration: str) -> float:
    return float(duration[:-2]) / 1000 if duration.endswith("ms") else float(duration[:-1])


def test_scrape_config_has_both_jobs_and_the_interval():
    config = scrape_config(["http://127.0.0.1:8001", "http://127.0.0.1:8002/"],
                           ["http://127.0.0.1:8080"], scrape_interval_s=5)
    assert config["global"] == {"scrape_interval": "5s", "scrape_timeout": "5s",
                                "evaluation_interval": "5s"}
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    assert jobs == {"vllm": ["127.0.0.1:8001", "127.0.0.1:8002"],
                    "labkit-gateway": ["127.0.0.1:8080"]}
    assert scrape_config(["http://a:1"])["global"]["scrape_timeout"] == "10s"
    with pytest.raises(ParameterError) as err:
        scrape_config([])
    assert err.value.param == "vllm_urls"
    with pytest.raises(ParameterError):
        scrape_config(["http://a:1"], scrape_interval_s=0)


def test_rule_tests_fire_after_for_and_resolve():
    script = overload_script()
    start_s = 30 * script.interval_s          # the overload's first step
    tests = rule_tests(chapter_rules(), script)
    cases = tests["tests"][0]["alert_rule_test"]
    for rule in chapter_rules():
        mine = [c for c in cases if c["alertname"] == rule.name]
        fired = [seconds(c["eval_time"]) for c in mine if c["exp_alerts"]]
        assert fired and min(fired) >= start_s + FOR_S, rule.name
        assert mine[0]["exp_alerts"] == [] and mine[-1]["exp_alerts"] == [], rule.name
    assert {c["alertname"] for c in cases} == {r.name for r in chapter_rules()}


def test_a_rule_the_script_never_fires_is_refused():
    with pytest.raises(ParameterError, match="never fires"):
        rule_tests([waiting_queue_above(1000)], overload_script())


@needs_promtool
@pytest.mark.real_engine
def test_promtool_accepts_config_rules_and_their_unit_tests(tmp_path):
    rules = rules_file(chapter_rules())
    config = scrape_config(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                           ["http://127.0.0.1:8080"], scrape_interval_s=15,
                           rule_files=["rules.yml"])
    assert "SUCCESS" in promtool(["check", "config"], {"prometheus.yml": config,
                                                       "rules.yml": rules})
    assert "6 rules found" in promtool(["check", "rules"], {"rules.yml": rules})
    tests = rule_tests(chapter_rules(), overload_script())
    assert "SUCCESS" in promtool(["test", "rules"], {"tests.yml": tests, "rules.yml": rules})


def test_prometheus_durations_by_hand():
    assert [prometheus_duration(s) for s in (0, 15, 90, 1.5, 0.3 * 3)] == \
        ["0s", "15s", "90s", "1500ms", "900ms"]
    with pytest.raises(ParameterError) as err:
        prometheus_duration(0.0005, "window_s")
    assert err.value.param == "window_s" and "whole number of milliseconds" in str(err.value)
    with pytest.raises(ParameterError):
        prometheus_duration(-1)


@needs_promtool
@pytest.mark.real_engine
def test_promtool_reads_every_duration_form(tmp_path):
    # Prometheus' own parser takes the config's intervals and a rule's for: and window.
    config = scrape_config(["http://127.0.0.1:8001"], scrape_interval_s=1.5,
                           evaluation_interval_s=90, rule_files=["rules.yml"])
    assert config["global"] == {"scrape_interval": "1500ms", "scrape_timeout": "1500ms",
                                "evaluation_interval": "90s"}
    rules = rules_file([preemption_rate_above(0.1, window_s=2.5, for_s=0)])
    assert rules["groups"][0]["rules"][0]["for"] == "0s"
    assert "[2500ms]" in rules["groups"][0]["rules"][0]["expr"]
    assert "SUCCESS" in promtool(["check", "config"], {"prometheus.yml": config,
                                                       "rules.yml": rules})


@needs_promtool
@pytest.mark.real_engine
def test_promtool_catches_a_wrong_expectation():
    """The unit tests can fail: claim an alert one step early and promtool says so."""
    tests = rule_tests(chapter_rules(), overload_script())
    cases = tests["tests"][0]["alert_rule_test"]
    first = next(k for k, c in enumerate(cases) if c["exp_alerts"])
    cases[first - 1]["exp_alerts"] = cases[first]["exp_alerts"]
    with pytest.raises(ParameterError, match="test rules failed"):
        promtool(["test", "rules"], {"tests.yml": tests,
                                     "rules.yml": rules_file(chapter_rules())})


@needs_promtool
@pytest.mark.real_engine
def test_promtool_rejects_a_broken_rule():
    broken = rules_file(chapter_rules())
    broken["groups"][0]["rules"][0]["expr"] = "rate(vllm:num_preemptions_total[5m]"
    with pytest.raises(ParameterError, match="check rules failed"):
        promtool(["check", "rules"], {"rules.yml": broken})


def test_dashboard_follows_grafanas_json_model():
    board = json.loads(json.dumps(dashboard()))
    assert board["schemaVersion"] == GRAFANA_SCHEMA_VERSION
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles)) == 8
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and panel["type"] == "timeseries"
        assert [t["refId"] for t in panel["targets"]] == list("AB"[:len(panel["targets"])])
    queries = panel_queries(board)
    assert any("vllm:time_to_first_token_seconds_bucket" in q and "0.99" in q
               for q in queries.values())
    with pytest.raises(ParameterError):
        dashboard(uid="short")


@needs_promtool
@pytest.mark.real_engine
def test_every_dashboard_expression_parses():
    queries = panel_queries(dashboard())
    out = promtool(["check", "rules"], {"dashboard.yml": recording_rules(queries)})
    assert f"{len(queries)} rules found" in out


def test_generated_rules_and_dashboard_name_only_live_metrics():
    queries = {r.name: r.promql for r in chapter_rules()} | panel_queries(dashboard())
    assert lint_queries(queries) == []
