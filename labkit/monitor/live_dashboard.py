"""A live dashboard in the notebook (:ref:`ch08-scraping`).

:class:`LiveDashboard` asks a monitor (:func:`labkit.monitor.fallback.start_monitor`: the
real Prometheus or labkit's scraper) the same PromQL a Grafana dashboard would, every few
seconds while a load runs, and redraws six panels: requests running and waiting per server,
KV-cache usage, fleet TTFT p50 and p99, generated tokens per second, and the gateway's
requests per second by backend. The plot is a PNG in an ``ipywidgets.Image`` and the status
line an ``ipywidgets.HTML``: updating them sends widget messages, not cell output, so the
dashboard works the same in JupyterLab and headless (nbval), where nobody looks.

The load it watches is the lab's: any coroutine, such as
:func:`labkit.harness.load_phases.scripted_load` (calm, overload, calm).
"""

from __future__ import annotations

import asyncio
import html
import io
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass

from labkit.checks import ParameterError, in_range
from labkit.http.urls import instance_of, normalize_url
from labkit.monitor.alert_watcher import AlertChange, AlertWatcher
from labkit.monitor.base import Monitor
from labkit.monitor.series import Labels
from labkit.process import wait_until_async
from labkit.units import prometheus_duration

#: The colour of the line drawn where an alert entered a state.
ALERT_COLOURS = {"pending": "tab:orange", "firing": "tab:red", "resolved": "tab:green",
                 "inactive": "tab:gray"}


@dataclass(frozen=True)
class Panel:
    """One plot: a title, a unit for its axis, and ``(legend, PromQL)`` pairs; ``{name}``
    in a legend becomes the series' server name (or its labels)."""

    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]


def default_panels(window_s: float = 10.0, *, gateway: bool = True) -> list[Panel]:
    """The six panels of chapter 8's dashboard, on vLLM's metric names (the gateway's
    panel only with ``gateway``); rates and quantiles over the last ``window_s`` seconds
    (a few scrape intervals: enough samples for ``rate()``, short enough to follow a lab's
    load)."""
    in_range("window_s", window_s, 0, low_open=True)
    w = prometheus_duration(window_s, "window_s")
    ttft = "vllm:time_to_first_token_seconds_bucket"
    panels = [
        Panel("Requests running", "requests", (("{name}", "vllm:num_requests_running"),)),
        Panel("Requests waiting", "requests", (("{name}", "vllm:num_requests_waiting"),)),
        Panel("KV-cache usage", "fraction", (("{name}", "vllm:kv_cache_usage_perc"),)),
        Panel("TTFT, fleet", "s", tuple(
            (f"p{q * 100:g}", f"histogram_quantile({q:g}, sum by (le) (rate({ttft}[{w}])))")
            for q in (0.5, 0.99))),
        Panel("Generated tokens per second", "tok/s", (
            ("{name}", f"sum by (instance) (rate(vllm:generation_tokens_total[{w}]))"),)),
    ]
    if gateway:
        panels.append(Panel("Gateway requests per second", "req/s", (
            ("{name}", f"sum by (backend) (rate(labkit_gateway_requests_total[{w}]))"),)))
    return panels


class LiveDashboard:
    """Panels of PromQL over ``monitor``, refreshed every ``every_s`` seconds while a load
    runs (:meth:`run`), shown in :attr:`widget` (chapter 8).

    ``names`` maps a server's or gateway's URL to the name its series get in legends
    (``{"http://127.0.0.1:8001": "server 0"}``); series whose labels name no known URL keep
    their labels. Every refresh also polls the active alerts (:attr:`alerts`, an
    :class:`~labkit.monitor.alert_watcher.AlertWatcher`), shown in the status line.
    """

    def __init__(self, monitor: Monitor, panels: Sequence[Panel] | None = None, *,
                 names: Mapping[str, str] | None = None, every_s: float = 2.0) -> None:
        import ipywidgets as widgets

        self.monitor = monitor
        self.panels = list(panels) if panels is not None \
            else default_panels(gateway=bool(monitor.gateway_urls))
        if not self.panels:
            raise ParameterError("panels", "panels must hold at least one Panel")
        self.every_s = in_range("every_s", every_s, 0, low_open=True)
        self.names: dict[str, str] = {}
        for url, name in (names or {}).items():
            self.names[instance_of(url)] = name
            self.names[normalize_url(url)] = name
        #: ``{(panel title, legend): [(t_s, value), ...]}``, NaN where a query had no value.
        self.history: dict[tuple[str, str], list[tuple[float, float]]] = {}
        #: The alert changes seen at each refresh (an
        #: :class:`~labkit.monitor.alert_watcher.AlertWatcher` on ``monitor``).
        self.alerts = AlertWatcher(monitor)
        self.refreshes = 0
        self.status = widgets.HTML()
        self.image = widgets.Image(format="png")
        #: What to ``display()``: the status line above the plot.
        self.widget = widgets.VBox([self.status, self.image])

    def legend(self, template: str, labels: Labels) -> str:
        """``template`` with ``{name}`` filled from the series' labels."""
        found = dict(labels)
        for key in ("instance", "backend"):
            if key in found:
                name = self.names.get(found[key], found[key])
                break
        else:
            name = ", ".join(f"{k}={v}" for k, v in labels) or "fleet"
        return template.format(name=name)

    def ask(self) -> tuple[float, list[tuple[tuple[str, str], float]]]:
        """Ask every panel's queries once, at one time, and poll the alerts: the time and
        ``((panel title, legend), value)`` rows. Blocking I/O, safe in a worker thread:
        it records nothing but the alert watcher's state."""
        t_s = self.monitor.now()
        rows = []
        for panel in self.panels:
            for template, expr in panel.queries:
                for labels, value in self.monitor.query(expr, at=t_s).items():
                    rows.append(((panel.title, self.legend(template, labels)), value))
        self.alerts.poll()
        return t_s, rows

    def record(self, t_s: float, rows: Sequence[tuple[tuple[str, str], float]]) -> None:
        """Append what :meth:`ask` returned to :attr:`history`."""
        for key, value in rows:
            self.history.setdefault(key, []).append((t_s, value))
        self.refreshes += 1

    def sample(self) -> float:
        """:meth:`ask`, then :meth:`record`; returns the time asked."""
        t_s, rows = self.ask()
        self.record(t_s, rows)
        return t_s

    def figure(self, history: Mapping[tuple[str, str], Sequence[tuple[float, float]]] |
               None = None, changes: Sequence[AlertChange] | None = None):
        """The panels as a matplotlib ``Figure`` (not registered with pyplot, so it can be
        drawn in any thread) of ``history`` (default :attr:`history`): one axis per panel,
        time in seconds on the monitor's clock; a vertical line wherever an alert changed
        state (``changes``, default those seen so far), coloured by the new state."""
        from matplotlib.figure import Figure

        history = self.history if history is None else history
        changes = self.alerts.changes if changes is None else changes

        columns = 3
        rows = math.ceil(len(self.panels) / columns)
        height_in = 3.2 * rows
        fig = Figure(figsize=(12, height_in))
        # Fixed margins (in inches: 0.6 above for the titles, 0.5 below for the labels):
        # matplotlib's constrained layout would triple the drawing time, which the
        # notebook's load generator shares (one interpreter, one GIL).
        fig.subplots_adjust(left=0.06, right=0.98, top=1 - 0.6 / height_in,
                            bottom=0.5 / height_in, wspace=0.25, hspace=0.5)
        axes = fig.subplots(rows, columns, squeeze=False).ravel()
        for ax, panel in zip(axes, self.panels, strict=False):
            for (title, legend), points in sorted(history.items()):
                if title == panel.title:
                    ax.plot([t for t, _ in points], [v for _, v in points], marker=".",
                            label=legend)
            for change in changes:
                ax.axvline(change.t_s, color=ALERT_COLOURS[change.state], linestyle="--",
                           linewidth=1)
            ax.set_title(panel.title)
            ax.set_ylabel(panel.unit)
            ax.set_xlabel("t (s)")
            if ax.has_data():
                ax.legend(fontsize="small")
        for ax in axes[len(self.panels):]:
            ax.set_visible(False)
        fig.suptitle(self.monitor.which, fontsize="medium")
        return fig

    def status_line(self) -> str:
        """One line: which monitor, the time, the refreshes, and the active alerts."""
        alerts = "; ".join(f"{a.name} {a.state} on {self.legend('{name}', a.labels)}"
                           for a in self.alerts.active) or "none"
        return (f"{self.monitor.which} | t = {self.monitor.now():.0f} s | "
                f"{self.refreshes} refreshes | alerts: {alerts}")

    @staticmethod
    def _png(figure) -> bytes:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=72)
        return buffer.getvalue()

    async def redraw(self) -> None:
        """Draw the history as it is now into the image widget (the drawing runs in a
        worker thread, on a copy; the widgets are set on this event loop) and update the
        status line."""
        snapshot = {key: list(points) for key, points in self.history.items()}
        changes = list(self.alerts.changes)
        self.image.value = await asyncio.to_thread(
            lambda: self._png(self.figure(snapshot, changes)))
        self.status.value = f"<code>{html.escape(self.status_line())}</code>"

    async def refresh(self) -> None:
        """Sample once (queries in a worker thread, recorded on this loop), then redraw."""
        self.record(*await asyncio.to_thread(self.ask))
        await self.redraw()

    async def run(self, load: Awaitable[object]) -> object:
        """Await ``load`` (a coroutine: ``scripted_load``, ``run_requests``, ...) while
        sampling every ``every_s`` seconds; the plot is redrawn after a sample when the
        previous drawing is done and at least three drawing times ago (drawing holds the
        interpreter, which the load generator needs: a busy machine draws less often), and
        once more at the end. Returns what ``load`` returned."""
        task = asyncio.ensure_future(load)
        drawing: asyncio.Future | None = None
        drawn_at, draw_s = -math.inf, 0.0

        async def timed_redraw() -> None:
            nonlocal draw_s
            started = time.monotonic()
            await self.redraw()
            draw_s = time.monotonic() - started

        try:
            while not task.done():
                started = time.monotonic()
                self.record(*await asyncio.to_thread(self.ask))
                if (drawing is None or drawing.done()) and started - drawn_at >= 3 * draw_s:
                    drawn_at = started
                    drawing = asyncio.ensure_future(timed_redraw())
                left = self.every_s - (time.monotonic() - started)
                await asyncio.wait([task], timeout=max(0.0, left))
        finally:
            if not task.done():
                task.cancel()
            if drawing is not None:
                await drawing
        await self.refresh()
        return task.result()

    async def wait_for_alert(self, name: str, state: str, timeout_s: float = 60.0) -> None:
        """Keep refreshing every ``every_s`` seconds until rule ``name`` has had an alert
        in ``state`` (``"resolved"`` after a load, say) and has none active; TimeoutError
        after ``timeout_s``."""
        in_range("timeout_s", timeout_s, 0, low_open=True)

        def settled() -> bool:
            return state in self.alerts.states(name) and not any(
                a.name == name for a in self.alerts.active)

        async def refreshed_and_settled() -> bool:
            await self.refresh()
            return settled()

        if settled():
            return
        try:
            await wait_until_async(refreshed_and_settled, timeout_s, self.every_s)
        except TimeoutError:
            raise TimeoutError(f"{name} was not {state} and quiet within {timeout_s} s; "
                               f"its changes: {self.alerts.states(name)}") from None

    def peaks(self) -> dict[tuple[str, str], float]:
        """The highest value each plotted series reached (NaN samples ignored)."""
        return {key: max((v for _, v in points if not math.isnan(v)), default=math.nan)
                for key, points in sorted(self.history.items())}
