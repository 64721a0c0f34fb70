"""The Horizontal Pod Autoscaler's loop, drawn from a real run of it (:ref:`ch05-hpa-kpa-keda`)."""

from __future__ import annotations

from collections.abc import Sequence
from textwrap import fill

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from labkit.autoscale import HorizontalPodAutoscaler, HPAScalingRules, Observation
from labkit.checks import ParameterError, positive_int


def run_hpa(hpa: HorizontalPodAutoscaler, syncs: Sequence[tuple[float, Sequence[float]]],
            replicas: int) -> list[Observation]:
    """Drive ``hpa`` through ``syncs`` and return what it observed at each
    (:ref:`ch05-hpa-kpa-keda`).

    Each sync is ``(time_s, per-pod values of hpa.metric)``; of the values, as many pods as
    there are replicas report (a list shorter than that: the rest have no metric yet). Each
    decision becomes the next sync's replica count, as in a cluster. The decisions are in
    ``hpa.decisions``.
    """
    positive_int("replicas", replicas)
    observations = []
    for time_s, values in syncs:
        observation = Observation.from_values(hpa.metric, list(values)[:replicas],
                                              replicas=replicas)
        replicas = hpa.decide(observation, now=time_s)
        observations.append(observation)
    return observations


def hpa_loop_figure(hpa: HorizontalPodAutoscaler, observations: Sequence[Observation],
                    highlight: int | None = None) -> Figure:
    """Observe, propose, stabilize, limit, scale: one HPA sync worked in numbers, above the
    whole run's replica counts (:ref:`ch05-hpa-kpa-keda`).

    ``hpa`` has made one decision per observation (:func:`run_hpa`). The loop's boxes carry
    the HPA's own settings (target, tolerance, windows, rate policies) and the numbers of
    decision ``highlight``: by default the first that changed the replica count. Below, for
    every sync: the replicas running, what the metric proposed, what the stabilization window
    let through and the new ``spec.replicas``.
    """
    decisions = hpa.decisions
    if len(decisions) != len(observations) or not decisions:
        raise ParameterError("observations", "pass the observations of every decision hpa "
                                             "made (run_hpa returns them)")
    if highlight is None:
        changed = [i for i, d in enumerate(decisions) if d.desired != d.current]
        highlight = changed[0] if changed else 0
    if not 0 <= highlight < len(decisions):
        raise ParameterError("highlight", f"highlight must be in [0, {len(decisions) - 1}]")
    decision, observation = decisions[highlight], observations[highlight]
    mean = observation.mean(hpa.metric)
    reporting = sum(hpa.metric in p.metrics for p in observation.pods)
    ratio = mean / hpa.target
    tolerance = hpa.scale_up.tolerance

    if decision.proposed is None:
        proposal = "no pod reports the metric:\nnothing changes"
    elif 1 - hpa.scale_down.tolerance <= ratio <= 1 + tolerance:
        proposal = (f"ratio {mean:g} / {hpa.target:g} = {ratio:.2f}\nwithin ±{tolerance:.0%}: "
                    f"keep {decision.proposed}")
    else:
        proposal = (f"⌈pods × metric / target⌉\n= ⌈{reporting} × {mean:g} / {hpa.target:g}⌉"
                    f" = {decision.proposed}")
    boxes = [
        ("observe", f"every {hpa.sync_period_s:g} s: {hpa.metric}\nmean {mean:g} over "
                    f"{reporting} of {observation.replicas} pods"),
        ("propose", proposal),
        ("stabilize", f"down: highest of last {hpa.scale_down.stabilization_window_s} s\n"
                      f"up: lowest of last {hpa.scale_up.stabilization_window_s} s\n"
                      f"→ {decision.stabilized}"),
        ("limit rate", fill(f"up: {_rate(hpa.scale_up)}", 34) + "\n"
                       + fill(f"down: {_rate(hpa.scale_down)}", 34) + "\n"
                       f"→ {decision.desired} (within {hpa.min_replicas}..{hpa.max_replicas})"),
        ("scale", f"spec.replicas\n{decision.current} → {decision.desired}"),
    ]
    fig, (loop, run) = plt.subplots(2, 1, figsize=(12, 6),
                                    gridspec_kw={"height_ratios": [1.1, 1]})
    width, gap = 2.25, 0.35
    for i, (title, body) in enumerate(boxes):
        x = i * (width + gap)
        loop.add_patch(FancyBboxPatch((x, 0), width, 1.3, boxstyle="round,pad=0.05",
                                      facecolor="#EAF0F8", edgecolor="#4C72B0"))
        loop.text(x + width / 2, 1.1, title, ha="center", va="center", fontsize=9,
                  fontweight="bold")
        loop.text(x + width / 2, 0.5, body, ha="center", va="center", fontsize=7.5,
                  gid=f"box:{title}")
        if i:
            loop.add_patch(FancyArrowPatch((x - gap, 0.65), (x, 0.65), arrowstyle="->",
                                           mutation_scale=10))
    right = len(boxes) * (width + gap) - gap
    loop.add_patch(FancyArrowPatch((right - width / 2, -0.05), (width / 2, -0.05),
                                   connectionstyle="arc3,rad=-0.12", arrowstyle="->",
                                   mutation_scale=10, color="grey"))
    loop.text(right / 2, -0.75, "new pods start, load the model and report metrics "
              "(until then they count as 0 on the way up, as the target on the way down)",
              ha="center", fontsize=7.5, color="dimgrey")
    loop.set_xlim(-0.1, right + 0.1)
    loop.set_ylim(-0.9, 1.5)
    loop.axis("off")
    loop.set_title(f"{hpa.name}: the sync at t = {decision.time_s:g} s", fontsize=9)

    times = [d.time_s for d in decisions]
    run.step(times, [d.desired for d in decisions], where="post", color="black",
             label="spec.replicas after each sync")
    run.plot([d.time_s for d in decisions if d.proposed is not None],
             [d.proposed for d in decisions if d.proposed is not None], "x", color="#DD8452",
             label="the metric's proposal")
    run.plot(times, [d.stabilized for d in decisions], "o", mfc="none", color="#4C72B0",
             label="after stabilization")
    run.axvline(decision.time_s, color="grey", linestyle=":", linewidth=1)
    run.set_xlabel("time (s)")
    run.set_ylabel("replicas")
    run.legend(fontsize=7, loc="center")
    fig.tight_layout()
    return fig


def _rate(rules: HPAScalingRules) -> str:
    """The rate policies in words: "4 pods / 15 s or 100 % / 15 s, whichever allows more"."""
    if rules.select_policy == "Disabled":
        return "disabled"
    parts = [f"{p.value} {'pods' if p.type == 'Pods' else '%'} / {p.period_s} s"
             for p in rules.policies]
    if len(parts) == 1:
        return parts[0]
    return " or ".join(parts) + (", whichever allows more" if rules.select_policy == "Max"
                                  else ", whichever allows less")
