"""What a monitor answers, whichever runs (:ref:`ch08-scraping`).

:class:`Monitor` is the small interface that both of chapter 8's monitors share:
:class:`~labkit.monitor.prometheus.PrometheusServer` (the real Prometheus, PromQL over its
HTTP API) and :class:`~labkit.monitor.fallback.LabkitMonitor` (labkit's scraper and
:mod:`labkit.monitor.promql` where Prometheus is not installed). ``which``, ``query``,
``query_range``, ``alerts``, ``now``, ``wait_scraped``, ``stop`` and a context manager are the
same on both, so a lab's cells are the same whichever ran, and ``which`` says which one that was.

Times are seconds since the monitor's ``origin_s`` (a whole Unix second taken at start):
small numbers for plots, and exact: Prometheus stamps samples in integer milliseconds, and
``(t_ms - origin_ms) / 1000`` keeps the differences that ``rate()`` divides by as exact as
Prometheus' own ``float64(t1 - t0) / 1000``.

One difference between Prometheus 2.x and 3.x matters when comparing numbers: a range
selector ``x[30s]`` evaluated at ``t`` takes the samples in ``[t - 30s, t]`` in 2.x
(``matrixIterSlice``, ``t >= mint``, v2.42.0 ``promql/engine.go``) and in ``(t - 30s, t]``
since 3.0, as :mod:`labkit.monitor.series` does. They differ only when a sample sits exactly
on ``t - 30s``; ``Monitor.time_off_samples`` picks evaluation times where none does.
In 2.x ``rate()`` also caps the extrapolation towards a counter's zero before its 1.1-interval
test, 3.x after (``extrapolatedRate``, ``promql/functions.go``); the two agree whenever the
window lies inside the scraped history, as it does in the tests and the lab.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range, positive_int
from labkit.http.urls import instance_of
from labkit.monitor.alerts import AlertRule
from labkit.monitor.series import Labels, Sample, SeriesStore
from labkit.process import wait_until
from labkit.units import prometheus_duration

#: An instant query's answer: one value per label set (``__name__`` left out).
InstantVector = dict[Labels, float]
#: A range query's or a range selector's answer: samples per label set.
RangeVector = dict[Labels, list[Sample]]
QueryResult = InstantVector | RangeVector


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


class Monitor(abc.ABC):
    """What both monitors share: the targets, the clock, the rules, waiting for scrapes and
    the context manager (chapter 8). Use :func:`~labkit.monitor.fallback.start_monitor`, or
    one of the two subclasses; ``which`` is one line saying which one runs, for the lab's
    banner."""

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

    @staticmethod
    def _check_range(start: float, end: float, step: float) -> None:
        """A range query's bounds: ``start <= end`` and ``step > 0`` (seconds)."""
        in_range("start", start)
        in_range("end", end, start)
        in_range("step", step, 0, low_open=True)

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
        window = prometheus_duration(window_s, "window_s")
        start_ms = round((at - window_s) * 1000)
        store = SeriesStore()
        for labels, samples in self.query(f"{name}[{window}]", at=at).items():
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
        lookback = self._lookback(window_s + 2 * self.scrape_interval_s)
        scrapes = {round(s.t_s * 1000) for samples in self.query(
            f"up[{lookback}]", at=t_ms / 1000).values() for s in samples}
        while t_ms - round(window_s * 1000) in scrapes:
            t_ms -= 1
        return t_ms / 1000

    def wait_scraped(self, rounds: int = 2, timeout_s: float = 30.0) -> None:
        """Wait until every target has been scraped successfully ``rounds`` times (``up``
        is 1 for each, at least ``rounds`` times in the last ``rounds + 2`` intervals):
        before that, ``rate()`` has fewer than two samples and answers nothing."""
        positive_int("rounds", rounds)
        lookback = self._lookback((rounds + 2) * self.scrape_interval_s)

        def scraped() -> bool:
            good = {dict(labels).get("instance"): sum(s.value == 1 for s in values)
                    for labels, values in self.query(f"up[{lookback}]").items()}
            return all(good.get(i, 0) >= rounds for i in self.instances)

        wait_until(scraped, timeout_s, self.scrape_interval_s / 4,
                   what=f"every target scraped {rounds} times ({self.which})")

    def wait_next_scrape(self, timeout_s: float = 30.0) -> float:
        """Wait until every target has been scraped after this call, so that what happened
        before it (a load that just ended) is in the monitor's samples; returns the time of
        the call."""
        since = self.now()
        lookback = self._lookback(2 * self.scrape_interval_s + 1)

        def scraped() -> bool:
            newest = {dict(labels).get("instance"): max(s.t_s for s in samples)
                      for labels, samples in self.query(f"up[{lookback}]").items()}
            return all(newest.get(i, -math.inf) > since for i in self.instances)

        wait_until(scraped, timeout_s, self.scrape_interval_s / 4,
                   what=f"every target scraped again ({self.which})")
        return since

    @staticmethod
    def _lookback(seconds: float) -> str:
        """A range selector's window of at least ``seconds``, in whole seconds."""
        return prometheus_duration(math.ceil(seconds))

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
