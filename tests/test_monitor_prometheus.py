"""labkit.monitor.prometheus, .promql, .fallback and .alert_watcher (chapter 8): the real
Prometheus scraping two ``labkit serve`` processes and a gateway, its PromQL against
labkit.monitor's math on the same samples, the fallback's subset of PromQL (hand-computed
values, and equal answers to Prometheus'), and the queue alert going pending, firing and
resolved under a scripted load."""

import asyncio
import contextlib
import math
import shutil
import time

import pytest

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.harness.fleet import BackendFleet, start_gateway
from labkit.harness.load import run_requests, varied_requests
from labkit.harness.load_phases import LoadPhase, scripted_load
from labkit.monitor import histogram_quantile, sum_rate, waiting_queue_above
from labkit.monitor.alert_watcher import AlertWatcher
from labkit.monitor.base import ActiveAlert
from labkit.monitor.fallback import LabkitMonitor, start_monitor
from labkit.monitor.prometheus import PROMETHEUS_ENV, PrometheusServer, prometheus_binary, rfc3339_s
from labkit.monitor.promql import UnsupportedQuery, evaluate
from labkit.monitor.series import SeriesStore

pytestmark = pytest.mark.real_engine  # the real Prometheus

needs_prometheus = pytest.mark.skipif(
    prometheus_binary() is None,
    reason="prometheus is not installed (make prometheus, or apt-get install prometheus), "
           "or LABKIT_PROMETHEUS=off hides it")

TTFT = "vllm:time_to_first_token_seconds"


# -- the fallback's PromQL subset, on samples written by hand ---------------------------------


def hand_store() -> SeriesStore:
    """Two counters scraped at t = 0..4 s (a: +10/s, b: +5/s) and one histogram (a) with
    buckets le=0.1, 0.5, +Inf growing by 10, 20, 25 per second from 0."""
    store = SeriesStore()
    for t in range(5):
        for instance, per_s in (("a", 10), ("b", 5)):
            store.add("c_total", {"instance": instance, "job": "j"}, t, per_s * t)
        for le, per_s in (("0.1", 10), ("0.5", 20), ("+Inf", 25)):
            store.add("h_bucket", {"instance": "a", "job": "j", "le": le}, t, per_s * t)
    return store


def by_instance(result):
    return {dict(labels)["instance"]: value for labels, value in result.items()}


def test_fallback_subset_on_hand_computed_samples():
    store = hand_store()
    # rate(c_total[4s]) at 4: samples at 1..4 s; a grew 30 in 3 s; 1 s to the window's start
    # (< 1.1 intervals) and the counter's zero is 1 s before its first sample (3 * 10 / 30):
    # extrapolated to 4 s, 40, over 4 s: 10/s. b likewise 5/s.
    assert by_instance(evaluate(store, "rate(c_total[4s])", 4)) == pytest.approx(
        {"a": 10.0, "b": 5.0})
    assert evaluate(store, "sum by (job) (rate(c_total[4s]))", 4) == \
        pytest.approx({(("job", "j"),): 15.0})
    assert evaluate(store, "sum(rate(c_total[4s]))", 4) == pytest.approx({(): 15.0})
    assert by_instance(evaluate(store, "c_total", 4)) == {"a": 40.0, "b": 20.0}
    assert by_instance(evaluate(store, "c_total", 2.5)) == {"a": 20.0, "b": 10.0}
    assert by_instance(evaluate(store, 'c_total{instance="b"}', 4)) == {"b": 20.0}
    # A range selector: (2, 4], the sample at 2 s left out (left-open, as Prometheus 3).
    window = evaluate(store, 'c_total{instance="a"}[2s]', 4)
    assert [(s.t_s, s.value) for s in next(iter(window.values()))] == [(3, 30), (4, 40)]
    assert by_instance(evaluate(store, "sum by (instance) (c_total) > 30", 4)) == {"a": 40.0}
    assert by_instance(evaluate(store, "c_total >= 20", 4)) == {"a": 40.0, "b": 20.0}
    # histogram_quantile over 10 s at 4: every sample is inside, each bucket starts at 0,
    # so no extrapolation: rates 4, 8, 10 per second. Median: rank 5 in (0.1, 0.5]:
    # 0.1 + 0.4 * (5 - 4) / (8 - 4) = 0.2. p90: rank 9 in the +Inf bucket: 0.5.
    q50 = "histogram_quantile(0.5, sum by (le) (rate(h_bucket[10s])))"
    assert evaluate(store, q50, 4) == pytest.approx({(): 0.2})
    q90 = "histogram_quantile(0.9, sum by (le, instance) (rate(h_bucket[10s])))"
    assert evaluate(store, q90, 4) == pytest.approx({(("instance", "a"),): 0.5})


@pytest.mark.parametrize("expr", [
    "avg(c_total)",
    'c_total{instance=~"a"}',
    'c_total{instance!="a"}',
    "c_total + 1",
    "rate(c_total[4s])[1m:]",
    "histogram_quantile(0.9, sum by (instance) (rate(h_bucket[10s])))",  # le summed away
    "c_total[4s] > 1",
])
def test_fallback_refuses_other_promql_clearly(expr):
    with pytest.raises(UnsupportedQuery) as caught:
        evaluate(hand_store(), expr, 4)
    assert isinstance(caught.value, ParameterError) and caught.value.param == "expr"
    message = str(caught.value)
    assert repr(expr) in message and "apt-get install prometheus" in message
    assert "histogram_quantile(Q, sum by (le, LABELS)" in message


def test_rfc3339_times_from_prometheus():
    # One day and 1.5 s after the epoch; the same instant written at UTC+02:00.
    assert rfc3339_s("1970-01-02T00:00:01.5Z") == 86401.5
    assert rfc3339_s("1970-01-02T02:00:01.250000000+02:00") == 86401.25
    with pytest.raises(ParameterError):
        rfc3339_s("yesterday")


def test_prometheus_can_be_hidden(monkeypatch, tmp_path):
    monkeypatch.setenv(PROMETHEUS_ENV, "off")
    assert prometheus_binary() is None
    with pytest.raises(FileNotFoundError, match="apt-get install prometheus"):
        PrometheusServer(["http://127.0.0.1:9"])
    with pytest.raises(ParameterError):
        LabkitMonitor([])


def test_a_prometheus_that_exits_at_start_is_reported_and_cleaned_up():
    # Started like every labkit server (labkit.process.ServerProcess, ready on /-/ready):
    # a binary that exits at once raises with its exit code, and leaves no folder behind.
    monitor = PrometheusServer(["http://127.0.0.1:9"], binary="/bin/false")
    with pytest.raises(RuntimeError, match="exited with code 1"):
        monitor.start()
    assert monitor._server is None and monitor._folder is None


class ScriptedAlerts:
    """A monitor stand-in whose ``alerts()`` answers from a list, one answer per poll."""

    def __init__(self, answers):
        self.answers, self.t_s = list(answers), 0.0

    def now(self):
        return self.t_s

    def alerts(self):
        self.t_s += 1.0
        return self.answers.pop(0)


def test_alert_watcher_reads_changes_between_polls():
    labels = (("instance", "a"),)

    def alert(state, active_at_s):
        return ActiveAlert("Q", labels, state, active_at_s, 5.0)

    # Poll 1: nothing; 2: pending since 1.5; 3: firing; 4: pending since 3.5, a new alert
    # (the firing one resolved between two polls); 5: gone before firing (dropped).
    watcher = AlertWatcher(ScriptedAlerts([[], [alert("pending", 1.5)],
                                           [alert("firing", 1.5)],
                                           [alert("pending", 3.5)], []]))
    for _ in range(5):
        watcher.poll()
    assert [(c.t_s, c.state, c.active_at_s) for c in watcher.changes] == [
        (1.0, "pending", 1.5), (2.0, "firing", 1.5), (3.0, "resolved", 1.5),
        (3.0, "pending", 3.5), (4.0, "inactive", 3.5)]
    assert watcher.states("Q") == ["pending", "firing", "resolved", "pending", "inactive"]
    assert watcher.active == []


# -- a fleet on loopback ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two ``labkit serve`` processes (the second runs at most 2 sequences) and a
    round-robin gateway in front of them."""
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    with BackendFleet(str(model), 2, max_num_seqs=(None, 2)) as backends:
        gateway = start_gateway(backends.urls, "round_robin")
        try:
            yield backends, gateway.base_url
        finally:
            gateway.stop()


@needs_prometheus
def test_prometheus_quantiles_equal_labkit_on_the_same_samples(fleet):
    backends, gateway = fleet
    window_s = 20
    with PrometheusServer(backends.urls, [gateway]) as prom:
        assert prom.which.startswith("Prometheus 2.") or prom.which.startswith("Prometheus 3.")
        prom.wait_scraped()
        ready = prom.now()
        results = asyncio.run(run_requests(gateway, backends.model,
                                           varied_requests(30, seed=3), concurrency=6))
        assert [r.error for r in results if r.outcome != "complete"] == []
        finished = prom.now()
        # The window must lie inside the scraped history (wait_scraped saw two rounds before
        # `ready`): then Prometheus 2.x and 3.x (and labkit) extrapolate rate() alike at its
        # start. It starts one scrape before the load, so a sample precedes the first request
        # however fast the load runs, and ends at least two scrapes after the last response.
        interval = prom.scrape_interval_s
        assert finished + 2 * interval < ready - interval + window_s, "the load outran the window"
        at_wanted = ready - interval + window_s
        while prom.now() < at_wanted + interval:  # every target's scrape before `at` is stored
            time.sleep(0.2)
        at = prom.time_off_samples(window_s, at=at_wanted)
        store = prom.samples(TTFT + "_bucket", window_s, at)
        instances = {dict(s.labels)["instance"] for s in store.select(TTFT + "_bucket")}
        assert instances == {u.removeprefix("http://") for u in backends.urls}
        for q in (0.5, 0.9, 0.99):
            for by in ((), ("instance",)):
                group = ", ".join(("le", *by))
                theirs = prom.query(f"histogram_quantile({q}, sum by ({group}) "
                                    f"(rate({TTFT}_bucket[{window_s}s])))", at=at)
                ours = histogram_quantile(q, store, TTFT, at, window_s=window_s, by=by)
                assert set(theirs) == set(ours)
                for key, value in theirs.items():
                    assert value == pytest.approx(ours[key], rel=1e-9, abs=1e-12), (q, key)
        fleet_p99 = prom.query(f"histogram_quantile(0.99, sum by (le) "
                               f"(rate({TTFT}_bucket[{window_s}s])))", at=at)[()]
        assert 0 < fleet_p99 < math.inf
        tokens = prom.samples("vllm:generation_tokens_total", window_s, at)
        theirs = prom.query(f"sum by (instance) (rate(vllm:generation_tokens_total"
                            f"[{window_s}s]))", at=at)
        ours = sum_rate(tokens, "vllm:generation_tokens_total", window_s, at, by=("instance",))
        assert theirs == pytest.approx(ours, rel=1e-9) and all(v > 0 for v in ours.values())


@needs_prometheus
def test_fallback_answers_as_prometheus_does(fleet):
    backends, gateway = fleet
    asyncio.run(run_requests(gateway, backends.model, varied_requests(6, seed=4),
                             concurrency=3))
    with PrometheusServer(backends.urls, [gateway]) as prom, \
            LabkitMonitor(backends.urls, [gateway]) as ours:
        prom.wait_scraped(rounds=5)
        ours.wait_scraped(rounds=5)
        # Idle servers: gauges and counters stand still, so both read the same numbers.
        for expr in ("up", "vllm:num_requests_running", "vllm:num_requests_waiting",
                     "sum by (instance) (vllm:generation_tokens_total)",
                     "sum by (backend, status) (labkit_gateway_requests_total)",
                     f'{TTFT}_count{{job="vllm"}}', "up == 1"):
            theirs, mine = prom.query(expr), ours.query(expr)
            assert theirs == mine, expr
            assert theirs, expr
        # No first token in the last 3 s: 0/0 buckets, NaN for both.
        idle = f"histogram_quantile(0.99, sum by (le) (rate({TTFT}_bucket[3s])))"
        assert all(math.isnan(v) for v in [*prom.query(idle).values(),
                                          *ours.query(idle).values()])
        now_prom, now_ours = prom.now(), ours.now()
        theirs = prom.query_range("vllm:num_requests_waiting", now_prom - 3, now_prom - 1, 1)
        mine = ours.query_range("vllm:num_requests_waiting", now_ours - 3, now_ours - 1, 1)
        assert set(theirs) == set(mine) and len(theirs) == 2
        for samples in [*theirs.values(), *mine.values()]:
            assert [s.value for s in samples] == [0.0, 0.0, 0.0], (theirs, mine)
        # Prometheus evaluates all of PromQL; the fallback says it does not.
        assert prom.query("avg(up)") == {(): 1.0}
        with pytest.raises(UnsupportedQuery):
            ours.query("avg(up)")


def test_fallback_monitor_on_a_live_fleet(fleet, monkeypatch):
    backends, gateway = fleet
    monkeypatch.setenv(PROMETHEUS_ENV, "off")
    with start_monitor(backends.urls, [gateway]) as monitor:
        assert isinstance(monitor, LabkitMonitor)
        assert monitor.which == "labkit.monitor's scraper (" + (
            "Prometheus hidden by LABKIT_PROMETHEUS=off)" if shutil.which("prometheus")
            else "Prometheus not installed: apt-get install prometheus)")
        monitor.wait_scraped(rounds=3)
        ups = {dict(k)["instance"]: (dict(k)["job"], v) for k, v in monitor.query("up").items()}
        assert ups == {i: (job, 1.0) for i, job in monitor.instances.items()}
        assert monitor.alerts() == []
        now = monitor.now()
        ranged = monitor.query_range("up", now - 1, now, 0.5)
        assert set(ranged) == set(monitor.query("up"))
        for samples in ranged.values():
            assert [s.t_s for s in samples] == pytest.approx([now - 1, now - 0.5, now])
            assert [s.value for s in samples] == [1.0, 1.0, 1.0]
        with pytest.raises(ParameterError):
            monitor.query_range("up[5s]", now - 2, now, 1)
        with pytest.raises(UnsupportedQuery):
            monitor.query("count(up)")
    with pytest.raises(RuntimeError, match="start"):
        monitor.query("up")


def test_queue_alert_pending_firing_resolved(fleet):
    """Ten requests kept in flight on a server that runs two at a time: eight wait. The
    alert (more than 2 waiting, for 4 s) goes pending, fires once 4 s have passed, and
    resolves after the load stops and the queue drains; with labkit's evaluator always, and
    with Prometheus' own rule engine where it is installed. (On a starved machine a scrape
    can miss the queue and the alert flap in between, or go pending once more while the queue
    drains and drop back without firing: it starts pending, fires, and is quiet at the end.)"""
    backends, gateway = fleet
    rule = waiting_queue_above(2, for_s=4)
    small = backends.urls[1]
    monitors = [LabkitMonitor(backends.urls, [gateway], [rule])]
    if prometheus_binary() is not None:
        monitors.append(PrometheusServer(backends.urls, [gateway], [rule]))
    with contextlib.ExitStack() as stack:
        for monitor in monitors:
            stack.enter_context(monitor)
        for monitor in monitors:
            monitor.wait_scraped()
        watchers = [AlertWatcher(m) for m in monitors]

        async def load_and_watch():
            load = asyncio.ensure_future(scripted_load(
                small, backends.model, [LoadPhase(10, 15), LoadPhase(0, 1)],
                varied_requests(16, seed=5, max_tokens=(48, 64)), clock=time.time))
            while not load.done():
                for watcher in watchers:
                    watcher.poll()
                await asyncio.wait([load], timeout=0.25)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                    quiet_after_firing(w.states(rule.name)) and not w.active
                    for w in watchers):
                await asyncio.sleep(0.25)
                for watcher in watchers:
                    watcher.poll()
            return load.result()

        overload, _ = asyncio.run(load_and_watch())
    assert all(r.outcome == "complete" for r in overload.results)
    for monitor, watcher in zip(monitors, watchers, strict=True):
        changes = [c for c in watcher.changes if c.name == rule.name]
        states = [c.state for c in changes]
        # In order, wherever a flap puts them: pending first, then firing, quiet last.
        assert states[0] == "pending" and quiet_after_firing(states), (monitor.which, states)
        assert {dict(c.labels)["instance"] for c in changes} == {small.removeprefix("http://")}
        fired = states.index("firing")
        pending, firing, last = changes[0], changes[fired], changes[-1]
        assert states[fired - 1] == "pending", (monitor.which, states)
        assert "resolved" in states[fired:], (monitor.which, states)
        started, ended = (overload.start_s - monitor.origin_s,
                          overload.end_s - monitor.origin_s)
        assert pending.active_at_s >= started, monitor.which
        assert firing.t_s - firing.active_at_s >= rule.for_s, monitor.which
        assert last.t_s >= ended, monitor.which


def quiet_after_firing(states: list[str]) -> bool:
    """Whether an alert's states show it fired and is now quiet: its last change is a
    resolution (it fired) or a drop back to inactive (a pending that never fired)."""
    return "firing" in states and states[-1] in ("resolved", "inactive")
