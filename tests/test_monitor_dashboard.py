"""labkit.monitor.live_dashboard (chapter 8): the live dashboard, headless (no display, no
kernel), on a scripted monitor and on a real ``labkit serve`` under the scripted load; its
queries are in the fallback's subset, and valid PromQL for promtool."""

import asyncio
import math
import shutil

import pytest
from conftest import serve_tiny_model

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.harness.load_phases import LoadPhase, scripted_load
from labkit.monitor.artifacts import promtool, recording_rules
from labkit.monitor.base import ActiveAlert, Monitor
from labkit.monitor.fallback import LabkitMonitor
from labkit.monitor.live_dashboard import LiveDashboard, Panel, default_panels
from labkit.monitor.promql import evaluate
from labkit.monitor.series import SeriesStore, labels_of
from labkit.simulate import BenchRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ScriptedMonitor(Monitor):
    """Answers each query from a script: ``answers[expr]`` is a list of results, one per
    call (the last one repeats); its clock reads 1 s, then 2 s, ... one second more after
    each round of the dashboard's queries (counted by ``clock_expr``)."""

    def __init__(self, answers, alerts=(), clock_expr="vllm:num_requests_waiting"):
        super().__init__(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
        self.which = "a scripted monitor"
        self.answers = {expr: list(results) for expr, results in answers.items()}
        self.calls = {expr: 0 for expr in answers}
        self.active = list(alerts)
        self.clock_expr = clock_expr

    def now(self):
        return 1.0 + self.calls.get(self.clock_expr, 0)

    def query(self, expr, at=None):
        results = self.answers.get(expr, [{}])
        k = self.calls.get(expr, 0)
        self.calls[expr] = k + 1
        return results[min(k, len(results) - 1)]

    def query_range(self, expr, start, end, step):
        raise AssertionError("the dashboard asks instant queries only")

    def alerts(self):
        return self.active

    def start(self):
        return self

    def stop(self):
        pass


def server_labels(port):
    return labels_of({"instance": f"127.0.0.1:{port}", "job": "vllm"})


def test_dashboard_records_names_and_peaks_headless():
    waiting = Panel("Requests waiting", "requests", (("{name}", "vllm:num_requests_waiting"),))
    ttft = Panel("TTFT", "s", (("p99", "histogram_quantile(0.99, sum by (le) (rate(x[10s])))"),))
    monitor = ScriptedMonitor({
        "vllm:num_requests_waiting": [{server_labels(8001): 0.0, server_labels(8002): 3.0},
                                      {server_labels(8001): 1.0, server_labels(8002): 6.0},
                                      {server_labels(8001): 0.0, server_labels(8002): 2.0}],
        "histogram_quantile(0.99, sum by (le) (rate(x[10s])))": [{(): math.nan}, {(): 0.4}],
    }, alerts=[ActiveAlert("VllmQueueSustained", server_labels(8002), "firing", 2.0, 6.0)])
    board = LiveDashboard(monitor, [waiting, ttft],
                          names={"http://127.0.0.1:8001": "server 0",
                                 "http://127.0.0.1:8002": "server 1"})
    assert asyncio.run(board.run(asyncio.sleep(0, result="done"))) == "done"
    asyncio.run(board.refresh())
    assert board.refreshes == 3
    # Peaks by hand: server 0 saw 0, 1, 0; server 1 saw 3, 6, 2; p99 NaN then 0.4 twice.
    assert board.peaks() == {("Requests waiting", "server 0"): 1.0,
                             ("Requests waiting", "server 1"): 6.0, ("TTFT", "p99"): 0.4}
    assert [t for t, _ in board.history[("Requests waiting", "server 0")]] == [1.0, 2.0, 3.0]
    assert bytes(board.image.value).startswith(PNG_MAGIC)
    assert "a scripted monitor" in board.status.value
    assert "VllmQueueSustained firing on server 1" in board.status.value
    assert [c.state for c in board.alerts.changes] == ["firing"]
    figure = board.figure()
    assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == [
        "Requests waiting", "TTFT"]


def test_default_panels_are_promql_the_fallback_evaluates():
    assert len(default_panels(gateway=False)) == 5
    panels = default_panels(window_s=15)
    assert [p.title for p in panels][-1] == "Gateway requests per second"
    queries = {f"{p.title} / {legend}": expr for p in panels for legend, expr in p.queries}
    store = SeriesStore()
    for expr in queries.values():
        evaluate(store, expr, 100.0)  # no UnsupportedQuery
    if shutil.which("promtool"):
        promtool(["check", "rules"], {"dashboard.yml": recording_rules(queries)})
    with pytest.raises(ParameterError):
        default_panels(window_s=0)


def test_the_module_leaves_the_grafana_dashboard_function_alone():
    # Importing a submodule sets an attribute of its package: a module named
    # labkit/monitor/dashboard.py would replace labkit.monitor.dashboard, the Grafana JSON.
    import labkit.monitor
    import labkit.monitor.live_dashboard  # noqa: F401

    assert callable(labkit.monitor.dashboard)
    assert labkit.monitor.dashboard()["panels"]


def test_load_phases_are_checked():
    with pytest.raises(ParameterError, match="concurrency"):
        LoadPhase(-1, 1.0)
    with pytest.raises(ParameterError, match="duration_s"):
        LoadPhase(2, 0)
    with pytest.raises(ParameterError, match="phases"):
        asyncio.run(scripted_load("http://127.0.0.1:9", "m", [], [BenchRequest("a", 1)]))
    with pytest.raises(ParameterError, match="panels"):
        LiveDashboard(ScriptedMonitor({}), [])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    with serve_tiny_model(model, "tiny", max_model_len=256, max_num_seqs=2) as (base, _):
        yield base


@pytest.mark.slow
def test_live_dashboard_on_a_real_server_under_scripted_load(server):
    """Four requests in flight on a server that runs two: the dashboard, refreshed while
    the load runs, sees requests running and waiting and tokens flowing; afterwards the
    server's token counter equals what the load asked for (``ignore_eos``: every request
    generates exactly ``max_tokens``)."""
    requests = [BenchRequest(f"monitoring lesson {i}", 48 + 16 * i) for i in range(5)]
    with LabkitMonitor([server], scrape_interval_s=0.5) as monitor:
        monitor.wait_scraped()
        board = LiveDashboard(monitor, names={server: "server"}, every_s=0.5)
        phases = asyncio.run(board.run(scripted_load(
            server, "tiny", [LoadPhase(4, 3.0), LoadPhase(0, 1.0)], requests,
            clock=monitor.now)))
        busy, idle = phases
        assert busy.start_s < busy.end_s <= idle.start_s < idle.end_s
        assert busy.end_s - busy.start_s >= 3.0 and idle.results == []
        sent = len(busy.results)
        assert sent >= 4 and all(r.outcome == "complete" for r in busy.results)
        monitor.wait_scraped(rounds=2)
        generated = monitor.query("sum(vllm:generation_tokens_total)")[()]
    assert generated == sum(requests[k % len(requests)].max_tokens for k in range(sent))
    peaks = board.peaks()
    assert peaks[("Requests running", "server")] >= 1
    assert peaks[("Generated tokens per second", "server")] > 0
    assert board.refreshes >= 3
    assert bytes(board.image.value).startswith(PNG_MAGIC)
    assert set(title for title, _ in board.history) <= {p.title for p in board.panels}
