"""Alerts as an operator sees them: every change of state, by polling (:ref:`ch08-alerts`).

A monitor lists the alerts that are pending or firing now (Prometheus' ``/api/v1/alerts``,
``ActiveAlerts``, v2.42.0 ``rules/alerting.go``; labkit's
:class:`~labkit.monitor.alerts.RuleEvaluator` likewise): a resolved alert leaves the list.
:class:`AlertWatcher` polls that list and turns it into transitions, ``pending``,
``firing``, then ``resolved`` (or ``inactive`` when the condition stopped before ``for:``
elapsed), stamped on the monitor's clock, which the lab's dashboard draws as lines.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.monitor.base import ActiveAlert, Monitor
from labkit.monitor.series import Labels


@dataclass(frozen=True)
class AlertChange:
    """An alert entering a state at ``t_s`` (monitor time), as seen by polling the active
    alerts: ``pending``, ``firing``, ``resolved`` (firing, then gone) or ``inactive``
    (pending, then gone: the condition stopped before ``for:`` elapsed)."""

    t_s: float
    name: str
    labels: Labels
    state: str
    active_at_s: float


class AlertWatcher:
    """Polls ``monitor.alerts()`` and records every change (chapter 8). Prometheus' API
    lists only pending and firing alerts: an alert that leaves the list was resolved (if it
    fired) or dropped (if it was pending)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.changes: list[AlertChange] = []
        self._last: dict[tuple[str, Labels], ActiveAlert] = {}

    @property
    def active(self) -> list[ActiveAlert]:
        """The alerts pending or firing at the last poll."""
        return list(self._last.values())

    def poll(self) -> list[AlertChange]:
        """Read the active alerts once; returns (and records) the changes since last time.

        An alert seen firing and now pending (or active since a later time) is a new alert
        for the same labels: the old one resolved between two polls, which is recorded
        before the new one's state."""
        t_s = self.monitor.now()
        now = {(a.name, a.labels): a for a in self.monitor.alerts()}
        changes = []

        def ended(alert: ActiveAlert) -> AlertChange:
            state = "resolved" if alert.state == "firing" else "inactive"
            return AlertChange(t_s, alert.name, alert.labels, state, alert.active_at_s)

        for key, alert in now.items():
            before = self._last.get(key)
            if before is not None and (before.active_at_s != alert.active_at_s
                                       or (before.state, alert.state) == ("firing", "pending")):
                changes.append(ended(before))
                before = None
            if before is None or before.state != alert.state:
                changes.append(AlertChange(t_s, alert.name, alert.labels, alert.state,
                                           alert.active_at_s))
        changes += [ended(alert) for key, alert in self._last.items() if key not in now]
        self._last = now
        self.changes += changes
        return changes

    def states(self, name: str) -> list[str]:
        """The states rule ``name``'s alerts went through, in order."""
        return [c.state for c in self.changes if c.name == name]
