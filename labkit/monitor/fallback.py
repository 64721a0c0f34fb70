"""labkit's own scraper in Prometheus' place, and the choice between the two
(:ref:`ch08-scraping`).

:func:`start_monitor` starts whichever monitor this machine has and returns it, started:
:class:`~labkit.monitor.prometheus.PrometheusServer` when the ``prometheus`` binary is
installed, else :class:`LabkitMonitor` (also when ``LABKIT_PROMETHEUS=off`` hides the
binary, as the tests and the lab's nbval run do to check both paths). :class:`LabkitMonitor`
is :class:`~labkit.monitor.scrape.Scraper` into a :class:`~labkit.monitor.series.SeriesStore`
and a :class:`~labkit.monitor.alerts.RuleEvaluator`, on the same targets, jobs, interval and
rules as Prometheus' config; it answers the PromQL shapes in
:data:`~labkit.monitor.promql.SUPPORTED_QUERIES` (:func:`~labkit.monitor.promql.evaluate`)
and refuses any other query with :class:`~labkit.monitor.promql.UnsupportedQuery`.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence

import httpx

from labkit.checks import ParameterError
from labkit.monitor.alerts import AlertRule, AlertState, RuleEvaluator
from labkit.monitor.base import ActiveAlert, Monitor, QueryResult, RangeVector
from labkit.monitor.prometheus import (INSTALL_HINT, PROMETHEUS_ENV, PrometheusServer,
                                       prometheus_binary)
from labkit.monitor.promql import evaluate
from labkit.monitor.scrape import DEFAULT_SCRAPE_TIMEOUT_S, Scraper
from labkit.monitor.series import Sample, SeriesStore


class LabkitMonitor(Monitor):
    """labkit.monitor's scraper in Prometheus' place (chapter 8): the same targets, jobs
    (``vllm``, ``labkit-gateway``), interval, timeout and rules, a scrape of every target
    then an evaluation of every rule each ``scrape_interval_s``.

    The scraper runs on its own asyncio loop in a daemon thread; :meth:`query` and
    :meth:`alerts` run on that loop too, between two scrapes' writes, so the store is never
    read half-updated and needs no lock.
    """

    def __init__(self, vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                 rules: Sequence[AlertRule] = (), *, scrape_interval_s: float = 1.0,
                 reason: str = f"Prometheus not installed: {INSTALL_HINT}") -> None:
        super().__init__(vllm_urls, gateway_urls, rules, scrape_interval_s=scrape_interval_s)
        self.which = f"labkit.monitor's scraper ({reason})"
        self.store = SeriesStore()
        self.evaluator = RuleEvaluator(self.rules, self.store)
        self.rounds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> LabkitMonitor:
        """Start scraping in a background thread; returns once the loop runs."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                        name="labkit-monitor")
        self._thread.start()
        ready.wait()
        return self

    def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        ready.set()
        try:
            self._loop.run_until_complete(self._scrape_loop())
        except BaseException as error:  # kept for the caller: a thread's error is silent
            self._error = error
        finally:
            self._loop.close()

    async def _scrape_loop(self) -> None:
        timeout_s = min(DEFAULT_SCRAPE_TIMEOUT_S, self.scrape_interval_s)  # as scrape_config
        async with httpx.AsyncClient(trust_env=False) as client:
            scrapers = [Scraper(urls, client, store=self.store, job=job, timeout_s=timeout_s,
                                clock=self.now)
                        for job, urls in (("vllm", self.vllm_urls),
                                          ("labkit-gateway", self.gateway_urls)) if urls]
            while not self._stop.is_set():
                started = time.monotonic()
                await asyncio.gather(*(s.scrape_once() for s in scrapers))
                self.evaluator.evaluate(self.now())
                self.rounds += 1
                try:
                    await asyncio.wait_for(self._stop.wait(), max(
                        0.0, self.scrape_interval_s - (time.monotonic() - started)))
                except TimeoutError:
                    pass

    def stop(self) -> None:
        """Stop scraping and end the thread."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self._thread = None

    def _on_loop(self, fn: Callable[[], object]):
        """Run ``fn`` on the scraper's loop, between scrapes, and return its result."""
        if self._error is not None:
            raise RuntimeError(f"the scraper stopped: {self._error!r}") from self._error
        if self._thread is None:
            raise RuntimeError("the monitor is not running: start() it first")

        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=30)

    def query(self, expr: str, at: float | None = None) -> QueryResult:
        """``expr`` (one of :data:`~labkit.monitor.promql.SUPPORTED_QUERIES`) at ``at``
        (monitor time; default now), on the scraped samples."""
        return self._on_loop(lambda: evaluate(self.store, expr,
                                              self.now() if at is None else at))

    def query_range(self, expr: str, start: float, end: float, step: float) -> RangeVector:
        """``expr`` evaluated at ``start``, ``start + step``, ... up to ``end``, as
        Prometheus' ``query_range`` (steps where a series has no value are left out)."""
        self._check_range(start, end, step)
        steps = [start + k * step for k in range(math.floor((end - start) / step + 1e-9) + 1)]

        def run() -> RangeVector:
            out: RangeVector = {}
            for t in steps:
                result = evaluate(self.store, expr, t)
                if result and isinstance(next(iter(result.values())), list):
                    raise ParameterError("expr", f"expr {expr!r} is a range selector: "
                                                 f"query_range needs an instant vector")
                for labels, value in result.items():
                    out.setdefault(labels, []).append(Sample(t, value))
            return out

        return self._on_loop(run)

    def alerts(self) -> list[ActiveAlert]:
        """The pending and firing alerts of ``evaluator``, the monitor's
        :class:`~labkit.monitor.alerts.RuleEvaluator`."""
        def active() -> list[ActiveAlert]:
            return sorted((ActiveAlert(a.rule, a.labels, a.state.value, a.active_at_s, a.value)
                           for a in self.evaluator.alerts()
                           if a.state is not AlertState.INACTIVE),
                          key=lambda a: (a.name, a.labels))

        return self._on_loop(active)


def start_monitor(vllm_urls: Sequence[str], gateway_urls: Sequence[str] = (),
                  rules: Sequence[AlertRule] = (), *,
                  scrape_interval_s: float = 1.0) -> Monitor:
    """Prometheus scraping ``vllm_urls`` and ``gateway_urls`` when it is installed, else
    labkit.monitor's scraper, started (chapter 8). Its ``which`` says which one runs."""
    if prometheus_binary() is not None:
        return PrometheusServer(vllm_urls, gateway_urls, rules,
                                scrape_interval_s=scrape_interval_s).start()
    reason = (f"Prometheus hidden by {PROMETHEUS_ENV}=off" if shutil.which("prometheus")
              else f"Prometheus not installed: {INSTALL_HINT}")
    return LabkitMonitor(vllm_urls, gateway_urls, rules, scrape_interval_s=scrape_interval_s,
                         reason=reason).start()
