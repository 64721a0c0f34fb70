"""A live dashboard in the notebook, and the scripted load it watches (:ref:`ch08-scraping`).

:class:`LiveDashboard` asks a monitor (:func:`labkit.monitor.prometheus.start_monitor`: the
real Prometheus or labkit's scraper) the same PromQL a Grafana dashboard would, every few
seconds while a load runs, and redraws six panels: requests running and waiting per server,
KV-cache usage, fleet TTFT p50 and p99, generated tokens per second, and the gateway's
requests per second by backend. The plot is a PNG in an ``ipywidgets.Image`` and the status
line an ``ipywidgets.HTML``: updating them sends widget messages, not cell output, so the
dashboard works the same in JupyterLab and headless (nbval), where nobody looks.

:func:`scripted_load` is the load: phases of a fixed number of requests in flight (a closed
loop: a new request leaves when one ends), such as calm, overload, calm. Against a server
started with a small ``--max-num-seqs``, requests beyond that number wait in its queue
(``vllm:num_requests_waiting``), which is what the queue alert watches.
"""

from __future__ import annotations

import asyncio
import html
import io
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from labkit.bench import BenchRequest
from labkit.checks import ParameterError, in_range
from labkit.gateway.backends import normalize_url
from labkit.gateway.loadgen import StreamResult, stream_completion
from labkit.monitor.prometheus import AlertChange, AlertWatcher, Monitor
from labkit.monitor.scrape import instance_of
from labkit.monitor.series import Labels

#: The colour of the line drawn where an alert entered a state.
ALERT_COLOURS = {"pending": "tab:orange", "firing": "tab:red", "resolved": "tab:green",
                 "inactive": "tab:gray"}


# -- the load ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPhase:
    """Keep ``concurrency`` requests in flight for ``duration_s`` seconds (0: idle)."""

    concurrency: int
    duration_s: float

    def __post_init__(self) -> None:
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) \
                or self.concurrency < 0:
            raise ParameterError("concurrency", f"concurrency must be an integer >= 0, "
                                                f"got {self.concurrency!r}")
        in_range("duration_s", self.duration_s, 0, low_open=True)


@dataclass
class PhaseResult:
    """What one phase sent, and when it started and ended on the load's clock (seconds)."""

    phase: LoadPhase
    start_s: float
    end_s: float
    results: list[StreamResult] = field(default_factory=list)


async def scripted_load(base_url: str, model: str, phases: Sequence[LoadPhase],
                        requests: Sequence[BenchRequest], *,
                        clock: Callable[[], float] = time.monotonic,
                        timeout_s: float = 300.0) -> list[PhaseResult]:
    """Run ``phases`` one after the other against ``base_url`` (chapter 8).

    In each phase ``concurrency`` workers send streamed completions back to back, taking
    ``requests`` in turn (cycling), until the phase's time is up; a request in flight then
    finishes, so the load falls as the queue drains, as it does when clients stop. The
    next phase starts on time regardless. ``clock`` stamps the phases (pass the monitor's
    ``now`` to line them up with its samples). Returns one
    :class:`~labkit.monitor.live_dashboard.PhaseResult` per phase.
    """
    if not phases:
        raise ParameterError("phases", "phases must hold at least one LoadPhase")
    if not requests:
        raise ParameterError("requests", "requests must hold at least one BenchRequest")
    most = max(p.concurrency for p in phases)
    limits = httpx.Limits(max_connections=2 * most + 4)
    turn = 0

    def next_request() -> BenchRequest:
        nonlocal turn
        request = requests[turn % len(requests)]
        turn += 1
        return request

    async with httpx.AsyncClient(base_url=normalize_url(base_url), timeout=timeout_s,
                                 limits=limits, trust_env=False) as client:
        async def worker(record: PhaseResult, until: float) -> None:
            while time.monotonic() < until:
                request = next_request()
                record.results.append(await stream_completion(client, model, request.prompt,
                                                              request.max_tokens))

        out: list[PhaseResult] = []
        workers: list[asyncio.Task] = []
        for phase in phases:
            record = PhaseResult(phase, clock(), math.nan)
            until = time.monotonic() + phase.duration_s
            workers += [asyncio.create_task(worker(record, until))
                        for _ in range(phase.concurrency)]
            await asyncio.sleep(phase.duration_s)
            record.end_s = clock()
            out.append(record)
        await asyncio.gather(*workers)
    return out


# -- the dashboard ------------------------------------------------------------------------------


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
    w = f"{window_s:g}s"
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
    :class:`~labkit.monitor.prometheus.AlertWatcher`), shown in the status line.
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
        #: :class:`~labkit.monitor.prometheus.AlertWatcher` on ``monitor``).
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
        """Await ``load`` (a coroutine: :func:`scripted_load`, ``run_requests``, ...) while
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
        deadline = time.monotonic() + in_range("timeout_s", timeout_s, 0, low_open=True)
        while state not in self.alerts.states(name) or any(
                a.name == name for a in self.alerts.active):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not {state} and quiet within {timeout_s} s; "
                                   f"its changes: {self.alerts.states(name)}")
            await asyncio.sleep(self.every_s)
            await self.refresh()

    def peaks(self) -> dict[tuple[str, str], float]:
        """The highest value each plotted series reached (NaN samples ignored)."""
        return {key: max((v for _, v in points if not math.isnan(v)), default=math.nan)
                for key, points in sorted(self.history.items())}
