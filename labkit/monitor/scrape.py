"""Scraping any number of servers' ``/metrics`` into a :class:`~labkit.monitor.SeriesStore`
(:ref:`ch08-scraping`).

What a Prometheus server does on each scrape, in Python: ``GET /metrics`` from every
target at once, parse the page (:func:`labkit.http.metrics.parse_samples`,
``prometheus_client``'s parser), and store each sample under its exposed name (a counter's
``_total``, a histogram's ``_bucket``/``_sum``/``_count``) with the target's ``instance``
and ``job`` labels added, all stamped with the time the scrape started. Each target also
gets the synthetic series ``up``: 1 after a successful scrape, 0 after a failed one, which
the "backend down" alert reads.

Defaults are Prometheus' own (prometheus/prometheus v3.9.1, ``config/config.go``,
``DefaultGlobalConfig``): scrape every 1 minute with a 10-second timeout. A lab under load
scrapes every second or two instead, to see a p99 move within a minute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from labkit.checks import ParameterError, in_range
from labkit.http.metrics import parse_samples
from labkit.http.urls import instance_of, normalize_url
from labkit.monitor.series import SeriesStore

#: Prometheus' ``scrape_interval`` and ``scrape_timeout`` defaults (module docstring).
DEFAULT_SCRAPE_INTERVAL_S = 60.0
DEFAULT_SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ScrapeResult:
    """What one scrape of one target brought back."""

    url: str
    t_s: float             # the scrape's start on the scraper's clock
    ok: bool
    samples: int           # samples stored (0 when the scrape failed)
    duration_s: float      # wall time of the request and the parse
    error: str | None = None


class Scraper:
    """Scrapes ``urls`` into ``store`` with one shared ``httpx.AsyncClient`` (chapter 8).

    ``clock`` gives the timestamp of each scrape in seconds (``time.monotonic`` by default;
    tests inject a scripted one). All targets are scraped concurrently, so one slow server
    delays nobody's sample time; each gets ``timeout_s`` seconds.
    """

    def __init__(self, urls: Sequence[str], client: httpx.AsyncClient, *,
                 store: SeriesStore | None = None, job: str = "labkit",
                 timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.urls = [normalize_url(u) for u in urls]
        if not self.urls:
            raise ParameterError("urls", "urls must name at least one server")
        if len(set(self.urls)) != len(self.urls):
            raise ParameterError("urls", f"urls must be distinct, got {list(urls)!r}")
        if not isinstance(job, str) or not job:
            raise ParameterError("job", f"job must be a non-empty string, got {job!r}")
        self.client = client
        self.store = SeriesStore() if store is None else store
        self.job = job
        self.timeout_s = in_range("timeout_s", timeout_s, 0, low_open=True)
        self.clock = clock

    async def scrape_once(self) -> list[ScrapeResult]:
        """Scrape every target once, concurrently; one timestamp for all of them."""
        t_s = self.clock()
        return list(await asyncio.gather(*(self._scrape(url, t_s) for url in self.urls)))

    async def _scrape(self, url: str, t_s: float) -> ScrapeResult:
        started = time.monotonic()
        labels = {"instance": instance_of(url), "job": self.job}
        try:
            response = await self.client.get(url + "/metrics", timeout=self.timeout_s)
            response.raise_for_status()
            samples = parse_samples(response.text)
        except (httpx.HTTPError, ParameterError) as error:
            self.store.add("up", labels, t_s, 0.0)
            return ScrapeResult(url, t_s, False, 0, time.monotonic() - started,
                                f"{type(error).__name__}: {error}")
        for name, sample_labels, value in samples:
            # honor_labels: false (the default): a page's own instance or job label is
            # kept as exported_instance / exported_job, the target's label wins.
            page = {(f"exported_{k}" if k in labels else k): v
                    for k, v in sample_labels.items()}
            self.store.add(name, {**page, **labels}, t_s, value)
        self.store.add("up", labels, t_s, 1.0)
        return ScrapeResult(url, t_s, True, len(samples), time.monotonic() - started)
