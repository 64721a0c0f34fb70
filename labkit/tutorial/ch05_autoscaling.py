"""The tutorial's autoscaler (its chapter 5), as written, to hold our numbers against
(:ref:`ch05-tutorial-wrong`).

Its ``AutoScaler`` averages GPU utilization, queue depth and latency over the last ten
samples and adds or removes one replica past a threshold, with a five-minute cooldown.
:class:`TutorialAutoScaler` is that class as it behaves, bugs included: its cooldown and its
history read the wall clock while its demo stamps samples with synthetic times, which the lab
shows; :func:`tutorial_demo` is that demo. The fix is
:class:`labkit.autoscale.ThresholdPolicy`, the same rule on the injected clock every policy in
:mod:`labkit.autoscale` takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from labkit.autoscale.threshold import GPUMetric, ScaleEvent, ThresholdRule, demo_metric
from labkit.checks import in_range, positive_int


class TutorialAutoScaler:
    """The tutorial's ``AutoScaler`` as it behaves, bugs included (chapter 5).

    Its samples carry their own timestamps, but two decisions read the wall clock,
    ``wall_clock()`` (``time.time`` by default, as in the tutorial):

    - the cooldown: ``wall_clock() - last_scale_time < cooldown``. Fed samples faster than
      real time (a replay, a simulation, its own demo), it scales once and then stays "in
      cooldown" for five minutes of *wall* time, whatever the samples' clock says;
    - the history: samples older than ``wall_clock() - 300`` are dropped as they arrive, so
      samples stamped on any other clock (a simulation starting at 0, yesterday's metrics)
      are all thrown away and it never scales at all.

    It also counts replicas itself (``current_replicas``) instead of reading them, so its
    count drifts from the real one as soon as anything else changes the Deployment.
    """

    def __init__(self, rule: ThresholdRule | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.rule = rule or ThresholdRule()
        self.wall_clock = wall_clock
        self.current_replicas = self.rule.min_replicas
        self.last_scale_time = 0.0  # the epoch: "long ago" only on the wall clock
        self.metrics_history: list[GPUMetric] = []

    def add_metric(self, metric: GPUMetric) -> None:
        self.metrics_history.append(metric)
        cutoff = self.wall_clock() - self.rule.history_s
        self.metrics_history = [m for m in self.metrics_history if m.timestamp > cutoff]

    def evaluate(self) -> tuple[str, int, str]:
        """``(action, replicas, reason)``: ``scale_up``, ``scale_down`` or ``none``."""
        if not self.metrics_history:
            return "none", self.current_replicas, "no metrics"
        verdict, reason = self.rule.verdict(self.metrics_history[-self.rule.window:])
        in_cooldown = self.wall_clock() - self.last_scale_time < self.rule.cooldown_s
        if verdict == "up" and not in_cooldown:
            if self.current_replicas < self.rule.max_replicas:
                self.current_replicas += 1
                self.last_scale_time = self.wall_clock()
                return "scale_up", self.current_replicas, reason
        elif verdict == "down" and not in_cooldown:
            if self.current_replicas > self.rule.min_replicas:
                self.current_replicas -= 1
                self.last_scale_time = self.wall_clock()
                return "scale_down", self.current_replicas, reason
        return "none", self.current_replicas, reason


def tutorial_demo(steps: int = 20, interval_s: float = 10.0, start_s: float | None = None,
                  scaler: TutorialAutoScaler | None = None) -> list[ScaleEvent]:
    """The tutorial's demo (chapter 5): ``steps`` samples ``interval_s`` apart through its
    autoscaler (``min_replicas=2, max_replicas=8``), returning what it would print.

    With ``start_s=None`` the samples are stamped as the tutorial stamps them, in the recent
    past of the wall clock, and the demo prints one scale-up at step 18. Stamp them on a
    simulation clock instead (``start_s=0``) and the same autoscaler never scales. The demo's
    load also ignores the replicas added (an open loop); :mod:`labkit.autoscale.simulate`
    closes it.
    """
    positive_int("steps", steps)
    in_range("interval_s", interval_s, 0, low_open=True)
    scaler = scaler or TutorialAutoScaler(ThresholdRule(min_replicas=2, max_replicas=8))
    events = []
    for i in range(steps):
        stamp = (scaler.wall_clock() - (steps - i) * interval_s if start_s is None
                 else start_s + i * interval_s)
        scaler.add_metric(demo_metric(i, stamp))
        action, replicas, reason = scaler.evaluate()
        if action != "none":
            events.append(ScaleEvent(i, action, replicas, reason))
    return events
