"""Alert rules with ``for:`` durations, evaluated in Python on scraped series (:ref:`ch08-alerts`).

An alerting rule is a condition over the metrics ("p99 TTFT above 2 s") and a duration it
must hold before anyone is paged. Prometheus' rule manager evaluates every rule on an
interval and moves each alert (one per label set the condition returns) through three
states, which :class:`RuleEvaluator` reproduces (prometheus/prometheus v3.9.1,
``rules/alerting.go``, ``AlertingRule.Eval``):

* the condition first holds at ``t``: the alert is **pending**, active since ``t``;
* it still holds at an evaluation ``>= t + for``: **firing** (with ``for: 0``, at once);
* it stops holding: a pending alert is dropped (**inactive**, nobody was told); a firing
  one is **resolved** (inactive, with its resolve time), unless ``keep_firing_for`` is set,
  in which case it keeps firing until the condition has been absent that long;
* a resolved alert is remembered for 15 minutes (``resolvedRetention``), so that it can be
  reported as resolved; the condition holding again starts a new pending alert.

Prometheus' defaults are ``for: 0`` and ``keep_firing_for: 0`` (``rules/alerting.go``); the
rules below keep them as defaults and take every threshold as a required argument: the
right p99 or queue length depends on the model and the service-level objective, and
chapter 8 teaches how to choose it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from labkit.checks import ParameterError, in_range
from labkit.monitor.series import (Labels, SeriesStore, histogram_quantile, latest_values, rate,
                                   sum_rate)
from labkit.units import prometheus_duration

#: ``resolvedRetention`` in rules/alerting.go (v3.9.1): 15 minutes.
RESOLVED_RETENTION_S = 15 * 60.0

#: A rule's condition: the labelled values for which it holds at a time (an instant vector
#: after the comparison, as PromQL's ``expr > threshold`` returns).
Condition = Callable[[SeriesStore, float], dict[Labels, float]]


class AlertState(str, Enum):
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule: a name, a condition and how long it must hold (chapter 8).

    ``promql`` is the same condition in PromQL, for a Prometheus rule file; ``condition``
    computes it in Python from a :class:`SeriesStore`.
    """

    name: str
    condition: Condition
    promql: str
    for_s: float = 0.0
    keep_firing_for_s: float = 0.0
    summary: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ParameterError("name", f"name must be an identifier-like alert name, "
                                         f"got {self.name!r}")
        if not callable(self.condition):
            raise ParameterError("condition", "condition must be callable(store, t_s)")
        in_range("for_s", self.for_s, 0)
        in_range("keep_firing_for_s", self.keep_firing_for_s, 0)


@dataclass
class Alert:
    """One alert instance: a rule and a label set, and where it stands."""

    rule: str
    labels: Labels
    state: AlertState
    value: float
    active_at_s: float
    fired_at_s: float | None = None
    resolved_at_s: float | None = None
    keep_firing_since_s: float | None = None


@dataclass(frozen=True)
class AlertEvent:
    """A state change of one alert at one evaluation: ``pending``, ``firing``,
    ``resolved`` (firing -> inactive) or ``inactive`` (pending -> dropped)."""

    rule: str
    labels: Labels
    t_s: float
    state: str
    value: float


class RuleEvaluator:
    """Evaluates ``rules`` on ``store`` and keeps every alert's state (chapter 8).

    Call :meth:`evaluate` at each evaluation time, in increasing order (Prometheus'
    ``evaluation_interval`` defaults to 1 minute; a lab evaluates every scrape).
    """

    def __init__(self, rules: Iterable[AlertRule], store: SeriesStore) -> None:
        self.rules = list(rules)
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ParameterError("rules", f"rules must have distinct names, got {names}")
        self.store = store
        self._alerts: dict[tuple[str, Labels], Alert] = {}
        self._last_t_s: float | None = None

    def evaluate(self, at_s: float) -> list[AlertEvent]:
        """Evaluate every rule at ``at_s`` (seconds) and return the state changes."""
        in_range("at_s", at_s)
        if self._last_t_s is not None and at_s <= self._last_t_s:
            raise ParameterError("at_s", f"at_s must be after the last evaluation "
                                         f"({self._last_t_s}), got {at_s}")
        self._last_t_s = at_s
        events: list[AlertEvent] = []
        for rule in self.rules:
            events += self._evaluate_rule(rule, at_s)
        return events

    def _evaluate_rule(self, rule: AlertRule, at_s: float) -> list[AlertEvent]:
        events = []
        holding = rule.condition(self.store, at_s)
        for labels, value in holding.items():
            alert = self._alerts.get((rule.name, labels))
            if alert is not None and alert.state is not AlertState.INACTIVE:
                alert.value, alert.keep_firing_since_s = value, None
                continue
            self._alerts[(rule.name, labels)] = Alert(rule.name, labels, AlertState.PENDING,
                                                      value, active_at_s=at_s)
            events.append(AlertEvent(rule.name, labels, at_s, "pending", value))
        for key, alert in list(self._alerts.items()):
            if key[0] != rule.name:
                continue
            if alert.labels not in holding:
                if alert.state is AlertState.INACTIVE:
                    if at_s - alert.resolved_at_s > RESOLVED_RETENTION_S:
                        del self._alerts[key]
                    continue
                if alert.state is AlertState.FIRING and rule.keep_firing_for_s > 0:
                    if alert.keep_firing_since_s is None:
                        alert.keep_firing_since_s = at_s
                    if at_s - alert.keep_firing_since_s < rule.keep_firing_for_s:
                        continue
                if alert.state is AlertState.PENDING:
                    del self._alerts[key]
                    events.append(AlertEvent(rule.name, alert.labels, at_s, "inactive",
                                             alert.value))
                else:
                    alert.state, alert.resolved_at_s = AlertState.INACTIVE, at_s
                    events.append(AlertEvent(rule.name, alert.labels, at_s, "resolved",
                                             alert.value))
                continue
            if alert.state is AlertState.PENDING and at_s - alert.active_at_s >= rule.for_s:
                alert.state, alert.fired_at_s = AlertState.FIRING, at_s
                events.append(AlertEvent(rule.name, alert.labels, at_s, "firing", alert.value))
        return events

    def alerts(self, state: AlertState | None = None) -> list[Alert]:
        """The alerts known now (pending, firing, and resolved within 15 minutes), or only
        those in ``state``."""
        return [a for a in self._alerts.values() if state is None or a.state is state]

    def state(self, rule: str) -> AlertState:
        """The highest state of ``rule``'s alerts: firing > pending > inactive (as
        Prometheus' ``AlertingRule.State``)."""
        if rule not in {r.name for r in self.rules}:
            raise ParameterError("rule", f"rule must be one of the evaluated rules, got {rule!r}")
        order = [AlertState.INACTIVE, AlertState.PENDING, AlertState.FIRING]
        states = [a.state for a in self._alerts.values() if a.rule == rule]
        return max(states, key=order.index, default=AlertState.INACTIVE)


# -- the chapter's rules, on vLLM's metric names ------------------------------------------


def _above(values: dict[Labels, float], threshold: float) -> dict[Labels, float]:
    """PromQL's ``vector > threshold``: NaN compares false, so it drops out too."""
    return {k: v for k, v in values.items() if not math.isnan(v) and v > threshold}


def ttft_p99_above(threshold_s: float, *, window_s: float = 300.0, for_s: float = 0.0,
                   quantile: float = 0.99) -> AlertRule:
    """p99 time to first token of each server over the last ``window_s`` seconds above
    ``threshold_s`` (chapter 8). The 5-minute default window is ours: five samples at
    Prometheus' default 1-minute scrape interval, enough for ``rate()`` to have two."""
    in_range("threshold_s", threshold_s, 0, low_open=True)
    in_range("quantile", quantile, 0, 1)
    name = "vllm:time_to_first_token_seconds"
    window = prometheus_duration(in_range("window_s", window_s, 0, low_open=True), "window_s")

    def condition(store: SeriesStore, at_s: float) -> dict[Labels, float]:
        return _above(histogram_quantile(quantile, store, name, at_s, window_s=window_s,
                                         by=("instance",)), threshold_s)

    return AlertRule(
        "VllmTtftP99High", condition,
        f"histogram_quantile({quantile:g}, sum by (le, instance) "
        f"(rate({name}_bucket[{window}]))) > {threshold_s:g}",
        for_s=for_s, summary=f"p{quantile * 100:g} TTFT above {threshold_s:g} s")


def waiting_queue_above(threshold: float, *, for_s: float = 0.0,
                        keep_firing_for_s: float = 0.0) -> AlertRule:
    """More than ``threshold`` requests waiting to be scheduled, sustained for ``for_s``
    seconds (chapter 8): the server is past its capacity, not just busy. Once firing, it
    stays so until the queue has been short for ``keep_firing_for_s`` seconds, so that one
    late scrape or one dip does not resolve it and page again a moment later."""
    in_range("threshold", threshold, 0)
    name = "vllm:num_requests_waiting"
    return AlertRule(
        "VllmQueueSustained",
        lambda store, at_s: _above(latest_values(store, name, at_s), threshold),
        f"{name} > {threshold:g}", for_s=for_s, keep_firing_for_s=keep_firing_for_s,
        summary=f"more than {threshold:g} requests waiting")


def kv_usage_above(fraction: float, *, for_s: float = 0.0) -> AlertRule:
    """KV-cache usage (``vllm:kv_cache_usage_perc``, a fraction: 1 means full) above
    ``fraction`` (chapter 8): preemptions follow when it reaches 1."""
    in_range("fraction", fraction, 0, 1)
    name = "vllm:kv_cache_usage_perc"
    return AlertRule(
        "VllmKvCacheNearlyFull",
        lambda store, at_s: _above(latest_values(store, name, at_s), fraction),
        f"{name} > {fraction:g}", for_s=for_s,
        summary=f"KV cache more than {fraction:.0%} full")


def preemption_rate_above(per_s: float, *, window_s: float = 300.0,
                          for_s: float = 0.0) -> AlertRule:
    """Preemptions per second of each server over ``window_s`` above ``per_s`` (chapter 8):
    requests are being evicted from the KV cache and recomputed."""
    in_range("per_s", per_s, 0)
    name = "vllm:num_preemptions_total"
    window = prometheus_duration(in_range("window_s", window_s, 0, low_open=True), "window_s")
    return AlertRule(
        "VllmPreempting",
        lambda store, at_s: _above(sum_rate(store, name, window_s, at_s, by=("instance",)),
                                   per_s),
        f"sum by (instance) (rate({name}[{window}])) > {per_s:g}", for_s=for_s,
        summary=f"more than {per_s:g} preemptions per second")


def error_ratio_above(ratio: float, *, window_s: float = 300.0, for_s: float = 0.0,
                      metric: str = "labkit_gateway_requests_total",
                      by: Sequence[str] = ("backend",)) -> AlertRule:
    """The share of requests answered with a 5xx status over ``window_s`` above ``ratio``
    (chapter 8). vLLM counts its own errors (``http_requests_total{status="5xx"}`` from its
    FastAPI instrumentator, ``vllm:request_success_total{finished_reason="error"}``), but
    this reads the gateway's ``labkit_gateway_requests_total{backend, status}`` (chapter 5)
    by default, because the gateway also sees the requests that never reached a server. With no
    requests in the window the ratio is 0/0 = NaN, which never alerts (as in PromQL)."""
    in_range("ratio", ratio, 0, 1)
    window = prometheus_duration(in_range("window_s", window_s, 0, low_open=True), "window_s")
    group = ", ".join(by)

    def condition(store: SeriesStore, at_s: float) -> dict[Labels, float]:
        total: dict[Labels, float] = {}
        errors: dict[Labels, float] = {}
        for series in store.select(metric):
            per_s = rate(series, window_s, at_s)
            if per_s is None:
                continue
            labels = dict(series.labels)
            key = tuple((k, labels.get(k, "")) for k in by)
            total[key] = total.get(key, 0.0) + per_s
            status = labels.get("status", "")
            if len(status) == 3 and status.startswith("5"):
                errors[key] = errors.get(key, 0.0) + per_s
        # Groups without a 5xx series have no left-hand side: no result, as in PromQL.
        return _above({k: (e / total[k] if total[k] else math.nan)
                       for k, e in errors.items()}, ratio)

    return AlertRule(
        "HighErrorRatio", condition,
        f'sum by ({group}) (rate({metric}{{status=~"5.."}}[{window}])) / '
        f"sum by ({group}) (rate({metric}[{window}])) > {ratio:g}",
        for_s=for_s, summary=f"more than {ratio:.0%} of requests failed")


def backend_down(*, for_s: float = 0.0, job: str | None = None) -> AlertRule:
    """A scrape target that did not answer its last scrape (``up == 0``, chapter 8)."""
    matchers = {} if job is None else {"job": job}
    selector = "up" if job is None else f'up{{job="{job}"}}'

    def condition(store: SeriesStore, at_s: float) -> dict[Labels, float]:
        return {k: v for k, v in latest_values(store, "up", at_s, **matchers).items()
                if v == 0}

    return AlertRule("BackendDown", condition, f"{selector} == 0", for_s=for_s,
                     summary="a server did not answer its scrape")
