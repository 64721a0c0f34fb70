"""A calculator widget: controls above a report that recomputes on every change (ipywidgets).

Chapter 1's memory calculator and chapter 7's TCO widget are both this: the controls, a
function that renders the report from them, and bad settings shown, not raised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import ipywidgets as widgets


def calculator(controls: Mapping[str, widgets.Widget], render: Callable[[], str]) -> widgets.VBox:
    """A box of ``controls`` and a report showing ``render()`` (plain text), redrawn whenever
    a control changes; a ``ValueError`` from ``render`` is shown as an invalid setting.

    The box exposes ``.controls`` (the dict) and ``.report`` (an ``HTML`` widget), so tests and
    exercises can drive it without a display.
    """
    report = widgets.HTML()

    def update(_=None) -> None:
        try:
            report.value = f"<pre>{render()}</pre>"
        except ValueError as err:
            report.value = f"<pre>Invalid setting: {err}</pre>"

    for control in controls.values():
        control.observe(update, names="value")
    update()
    box = widgets.VBox([*controls.values(), report])
    box.controls, box.report = dict(controls), report
    return box
