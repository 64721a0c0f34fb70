"""Exploring a TCO: cost against volume, which inputs move the answer most, and a widget
(chapter 7, from :ref:`ch07-three-ways` on).

A TCO has a dozen inputs, each known only to within a range: electricity from 6 to 19 cents a
kWh across US states, PUE from 1.1 to 1.6, a server's price from one quote to another. A
**tornado** swings each input from the low to the high end of its sourced range, the others
held at the base case, and sorts the bars by how far the answer moves: the inputs at the top
are the ones worth pinning down before deciding. :func:`tco_widget` puts the same inputs on
sliders (ipywidgets); :func:`tco_report`, the function behind it, runs without a display.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

from labkit.checks import ParameterError
from labkit.cost.tco import Scenario, capex_for, input_range
from labkit.widgets import calculator

#: Volumes at which the cost curves are drawn, besides both sides of every step.
_POINTS = 600


def plot_cost_vs_volume(scenario: Scenario, max_tokens_month: float | None = None, ax=None):
    """Monthly cost against monthly volume (:ref:`ch07-three-ways`): the API's straight line, the
    self-hosted step function (a server more at each step) and, if the scenario has one,
    the cloud's; dotted lines mark where the cheaper option changes."""
    b = scenario.breakeven()
    if max_tokens_month is None:
        last = b.stable_tokens_month if not b.never else 0.0
        max_tokens_month = max(3 * scenario.server_capacity_tokens_month, 1.5 * last)
    volumes = np.linspace(max_tokens_month / _POINTS, max_tokens_month, _POINTS)
    # Both sides of every step edge, so the steps are drawn vertical.
    edges = scenario.server_capacity_tokens_month * np.arange(1, _POINTS)
    edges = edges[edges < max_tokens_month]
    volumes = np.unique(np.concatenate([volumes, edges * (1 - 1e-9), edges * (1 + 1e-9)]))
    costs = [scenario.costs(v) for v in volumes]
    ax = ax or plt.subplots(figsize=(8, 4))[1]
    api = scenario.api
    ax.plot(volumes, [c.api_usd for c in costs], label=f"API {api.provider} {api.model}")
    ax.plot(volumes, [c.self_hosted_usd for c in costs], label="self-hosted")
    if scenario.cloud is not None:
        ax.plot(volumes, [c.cloud_usd for c in costs], label="cloud GPUs", linestyle="--")
    for crossing in b.crossings:
        if crossing.tokens_month <= max_tokens_month:
            ax.axvline(crossing.tokens_month, color="0.5", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens per month (the whole mix)")
    ax.set_ylabel("US dollars per month")
    ax.set_title("self-hosting is never cheaper: a full server costs more than the API "
                 "charges for its tokens" if b.never else
                 f"self-hosting cheaper above {b.first_tokens_month:.3g} tokens/month",
                 fontsize="small", wrap=True)
    ax.legend(fontsize="small")
    return ax


@dataclass(frozen=True)
class Swing:
    """One input of a :class:`~labkit.cost.tco.Scenario` (a dotted path such as
    ``"hardware.pue"``) and the two ends it is swung between, with where they come from.

    The ends are usually numbers; they may be whole objects (two API price cards for the same
    model, at ``"api"``), then ``low_label`` and ``high_label`` name them in the plot.
    """

    path: str
    low: object
    high: object
    label: str
    provenance: str
    low_label: str = ""
    high_label: str = ""

    def __post_init__(self) -> None:
        if self.numeric and not self.low <= self.high:
            raise ParameterError("low", f"low must be <= high, got {self.low} > {self.high}")

    @property
    def numeric(self) -> bool:
        return all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                   for v in (self.low, self.high))

    def end_labels(self) -> tuple[str, str]:
        return (self.low_label or _fmt(self.low), self.high_label or _fmt(self.high))


_SOURCED = (
    ("hardware.electricity_usd_kwh", "electricity_usd_kwh", "electricity $/kWh"),
    ("hardware.pue", "pue", "PUE"),
    ("hardware.server_power_ratio", "server_power_ratio", "server power / GPU TDP"),
    ("hardware.gpu_power_fraction", "gpu_power_fraction", "average draw / maximum"),
    ("hardware.colocation_usd_kw_month", "colocation_usd_kw_month", "colocation $/kW-month"),
    ("hardware.depreciation_years", "depreciation_years", "depreciation years"),
)


def sourced_swings(scenario: Scenario) -> list[Swing]:
    """Swings over the sourced ranges of ``labkit/data``: the TCO inputs of
    ``tco_inputs.csv``, and the server price from ``gpu_capex.csv`` when that table prices a
    server of the scenario's GPU and size (chapter 7)."""
    swings = []
    for path, name, label in _SOURCED:
        low, high = input_range(name)
        swings.append(Swing(path, low.value, high.value, label,
                            f"low: {low.provenance()}; high: {high.provenance()}"))
    hardware = scenario.hardware
    try:
        rows = capex_for(hardware.gpu, gpus=hardware.gpus_per_server)
    except ParameterError:
        return swings  # no server price of this size in the table: nothing sourced to swing
    low = min(rows, key=lambda r: r.price_low_usd)
    high = max(rows, key=lambda r: r.price_high_usd)
    swings.append(Swing("hardware.capex_per_server_usd", low.price_low_usd, high.price_high_usd,
                        "server price $", f"low: {low.provenance()}; high: {high.provenance()}"))
    return swings


METRICS: dict[str, tuple[str, Callable[[Scenario], float]]] = {
    "self_minus_api_usd": ("self-hosted minus API, $/month",
                           lambda s: s.costs().self_minus_api_usd),
    "self_hosted_usd": ("self-hosted cost, $/month", lambda s: s.costs().self_hosted_usd),
    "breakeven_tokens_month": (
        "breakeven volume, tokens/month (inf: never)",
        lambda s: (math.inf if (b := s.breakeven()).never else b.first_tokens_month)),
}
"""The answers a tornado can measure: name -> (axis label, function of a scenario)."""


@dataclass(frozen=True)
class TornadoBar:
    """The answer at the base case and with one input at each end of its range."""

    swing: Swing
    base: float
    at_low: float
    at_high: float

    @property
    def effect(self) -> float:
        """How far the answer moves across the range (inf when one end says "never")."""
        if math.isinf(self.at_low) or math.isinf(self.at_high):
            return 0.0 if self.at_low == self.at_high else math.inf
        return abs(self.at_high - self.at_low)


def tornado(scenario: Scenario, swings: Sequence[Swing],
            metric: str = "self_minus_api_usd") -> list[TornadoBar]:
    """Swing each input over its range, one at a time, and sort by effect, largest first
    (chapter 7). Ties keep the order of ``swings``."""
    if metric not in METRICS:
        raise ParameterError("metric", f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    measure = METRICS[metric][1]
    base = measure(scenario)
    bars = []
    for swing in swings:
        scenario.value(swing.path)  # an unknown path fails here, before any work
        bars.append(TornadoBar(swing, base,
                               measure(scenario.with_value(swing.path, swing.low)),
                               measure(scenario.with_value(swing.path, swing.high))))
    return sorted(bars, key=lambda b: -b.effect)


def _fmt(x: object) -> str:
    if isinstance(x, numbers.Real):
        return "never" if math.isinf(x) else f"{x:,.4g}"
    return str(x)


def plot_tornado(bars: Sequence[TornadoBar], metric: str = "self_minus_api_usd", ax=None):
    """Horizontal bars from the answer at each input's low end to its high end, the largest
    effect on top; the base case is the vertical line (chapter 7). An end where the
    answer is "never" is drawn to the edge of the axes and labelled."""
    ax = ax or plt.subplots(figsize=(8, 0.5 * len(bars) + 1.2))[1]
    finite = [v for b in bars for v in (b.base, b.at_low, b.at_high) if math.isfinite(v)]
    span = (max(finite) - min(finite)) or 1.0
    edge = max(finite) + 0.1 * span
    for row, bar in enumerate(reversed(bars)):
        low, high = (edge if math.isinf(v) else v for v in (bar.at_low, bar.at_high))
        ax.barh(row, high - bar.base, left=bar.base, color="tab:red", alpha=0.7)
        ax.barh(row, low - bar.base, left=bar.base, color="tab:blue", alpha=0.7)
        low_label, high_label = bar.swing.end_labels()
        ax.text(max(low, high, bar.base), row, f"  {low_label} .. {high_label}", va="center",
                fontsize="small")
    ax.axvline(bars[0].base if bars else 0, color="black", linewidth=1)
    ax.set_yticks(range(len(bars)), [b.swing.label for b in reversed(bars)])
    ax.set_xlabel(METRICS[metric][0])
    ax.set_title("blue: input at its low end, red: at its high end", fontsize="small")
    return ax


def tco_report(scenario: Scenario) -> str:
    """The widget's text: the three monthly bills, the servers, the breakeven and the
    payback, for one scenario (chapter 7). Plain text, so it can be tested headless."""
    costs = scenario.costs()
    month = costs.self_hosted
    lines = [
        f"traffic: {costs.traffic.total_tokens:,.4g} tokens/month "
        f"({costs.traffic.output_tokens:,.4g} output)",
        f"API:         ${costs.api_usd:>12,.0f} / month",
        f"self-hosted: ${costs.self_hosted_usd:>12,.0f} / month  ({costs.servers} server(s), "
        f"{costs.gpus_needed} GPU(s) needed)",
        f"   depreciation ${month.depreciation_usd:,.0f}, power ${month.power_usd:,.0f}, "
        f"colocation ${month.colocation_usd:,.0f}, staff ${month.staff_usd:,.0f}",
    ]
    if costs.cloud_usd is not None:
        lines.append(f"cloud GPUs:  ${costs.cloud_usd:>12,.0f} / month")
    lines.append(f"breakeven vs API: {scenario.breakeven()}")
    lines.append(f"payback vs API: {scenario.payback('api')}")
    if scenario.cloud is not None:
        lines.append(f"payback vs cloud: {scenario.payback('cloud')}")
    return "\n".join(lines)


def tco_widget(scenario: Scenario, swings: Sequence[Swing] | None = None) -> widgets.VBox:
    """Sliders over the scenario's inputs and its monthly volume, and the report of
    :func:`tco_report` updated live (chapter 7, lab 07).

    One slider per numeric swing (default: :func:`sourced_swings`), spanning its range and
    the base value; the volume slider is logarithmic, from 1/100 to 100 times the base
    traffic. The box exposes ``.controls`` (path -> slider), ``.report`` (an ``HTML``
    widget) and ``.scenario()`` (the scenario the sliders describe), so tests and exercises
    can drive it.
    """
    swings = list(sourced_swings(scenario) if swings is None else swings)
    controls: dict[str, widgets.Widget] = {}
    for swing in (w for w in swings if w.numeric):
        value = float(scenario.value(swing.path))
        low, high = min(swing.low, value), max(swing.high, value)
        controls[swing.path] = widgets.FloatSlider(
            value=value, min=low, max=high, step=(high - low) / 100 or 1.0,
            description=swing.label, readout_format=".4g",
            style={"description_width": "initial"}, layout=widgets.Layout(width="60%"))
    base_total = scenario.traffic.total_tokens
    exponent = math.log10(base_total)
    controls["traffic"] = widgets.FloatLogSlider(
        value=base_total, base=10, min=exponent - 2, max=exponent + 2, step=0.01,
        description="tokens/month", readout_format=".3g",
        style={"description_width": "initial"}, layout=widgets.Layout(width="60%"))
    def current() -> Scenario:
        s = scenario
        for path, control in controls.items():
            if path != "traffic":
                s = s.with_value(path, control.value)
        return s.with_value("traffic", s.traffic.scaled_to(controls["traffic"].value))

    box = calculator(controls, lambda: tco_report(current()))
    box.scenario = current
    return box
