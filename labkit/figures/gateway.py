"""The endpoint picker's filter, score, pick, drawn from one real routing decision
(:ref:`ch05-choosing-backend`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from labkit.gateway.endpoints import Endpoint, NoEndpointError, RoutingRequest
from labkit.gateway.routing import Pipeline, make_router

KEPT, DROPPED = "✓", "✗"


@dataclass(frozen=True)
class RoutingTrace:
    """What each stage of a :class:`~labkit.gateway.routing.Pipeline` did to each endpoint.

    ``filters[f][i]`` is :data:`KEPT`, :data:`DROPPED` or ``""`` (endpoint ``i`` was dropped
    by an earlier filter); ``scores[s][i]`` is scorer ``s``'s score in [0, 1] (``None`` for a
    dropped endpoint); ``totals[i]`` the weighted sum; ``picked`` the chosen endpoint.
    """

    stage_names: tuple[str, ...]  # the filters', then the scorers', then the picker's
    weights: tuple[float, ...]    # one per scorer
    endpoints: tuple[Endpoint, ...]
    filters: tuple[tuple[str, ...], ...]
    scores: tuple[tuple[float | None, ...], ...]
    totals: tuple[float | None, ...]
    picked: Endpoint


def endpoint_picker_example() -> tuple[Pipeline, RoutingRequest, list[Endpoint], float]:
    """The routing decision that :numref:`fig-endpoint-picker` shows: ``(pipeline, request,
    endpoints, now)``.

    The section's three endpoints (``a`` idle, ``b`` with a queue, ``c`` with a fuller KV
    cache) plus ``d``, ejected after failed probes, and ``e``, whose KV cache is 86 % full.
    The pipeline is ``make_router("endpoint_picker", seed=0)``, and an earlier turn of the
    same conversation was routed to ``b``, so its prefix index holds most of the prompt there.
    """
    now = 100.0
    endpoints = [
        Endpoint("http://a", num_requests_waiting=0, num_requests_running=4,
                 kv_cache_usage=0.30, metrics_time=now),
        Endpoint("http://b", num_requests_waiting=3, num_requests_running=16,
                 kv_cache_usage=0.55, metrics_time=now),
        Endpoint("http://c", num_requests_waiting=1, num_requests_running=9,
                 kv_cache_usage=0.79, metrics_time=now),
        Endpoint("http://d", healthy=False),
        Endpoint("http://e", num_requests_waiting=0, num_requests_running=30,
                 kv_cache_usage=0.86, metrics_time=now),
    ]
    pipeline = make_router("endpoint_picker", seed=0)
    contract = "Summarize the following contract: " + "The parties agree that ... " * 40
    pipeline.record(RoutingRequest(model="llama", prompt=contract), endpoints[1])
    request = RoutingRequest(model="llama", prompt=contract + "Now list the termination clauses.")
    return pipeline, request, endpoints, now


def trace_routing(pipeline: Pipeline, request: RoutingRequest, endpoints: Sequence[Endpoint],
                  now: float) -> RoutingTrace:
    """Run ``pipeline`` on one request, one stage at a time, and keep what each stage did
    (:ref:`ch05-choosing-backend`).

    The stages are the pipeline's own plugin objects, run in its order; the totals are
    :meth:`Pipeline.scored`'s (each score clamped to [0, 1], times its weight) and the pick
    is the pipeline's picker on them, called once: a random filter or tie-break draws once,
    so the figure shows the decision that was made.
    """
    endpoints = tuple(endpoints)
    alive = list(endpoints)
    filter_rows = []
    for stage in pipeline.filters:
        kept = stage.filter(request, alive, now)  # SaturatedError if it sheds the request
        filter_rows.append(tuple(KEPT if e in kept else DROPPED if e in alive else ""
                                 for e in endpoints))
        alive = kept
    if not alive:
        raise NoEndpointError(f"no routable endpoint among {len(endpoints)}")
    position = {id(e): i for i, e in enumerate(alive)}  # Endpoint compares by identity
    totals = [0.0 if id(e) in position else None for e in endpoints]
    score_rows = []
    for scorer, weight in pipeline.scorers:
        values = scorer.score(request, alive, now)
        row: list[float | None] = []
        for i, e in enumerate(endpoints):
            score = (min(max(values[position[id(e)]], 0.0), 1.0) if id(e) in position
                     else None)
            row.append(score)
            if score is not None:
                totals[i] += weight * score
        score_rows.append(tuple(row))
    scored = [(e, totals[i]) for i, e in enumerate(endpoints) if totals[i] is not None]
    picked = pipeline.picker.pick(request, scored)
    names = (tuple(f.name for f in pipeline.filters) + tuple(s.name for s, _ in pipeline.scorers)
             + (pipeline.picker.name,))
    return RoutingTrace(names, tuple(w for _, w in pipeline.scorers), endpoints,
                        tuple(filter_rows), tuple(score_rows), tuple(totals), picked)


def routing_figure(trace: RoutingTrace, now: float | None = None) -> Figure:
    """The filter, score, pick pipeline as a table: endpoints as rows, stages as columns
    (:ref:`ch05-choosing-backend`).

    Each column is headed by the real stage's name. Filters show which endpoints pass (✓) or
    are dropped (✗); scorers show each score and its weight; the total column is the
    weighted sum and the picker's column marks the winner. Each endpoint's row starts with
    the metrics the stages read (waiting requests, KV cache usage; with ``now``, how old they
    are).
    """
    n_filters, n_scorers = len(trace.filters), len(trace.scores)
    headers = (["endpoint (scraped metrics)"] + list(trace.stage_names[:n_filters])
               + [f"{name}\n× {w:g}" for name, w in zip(trace.stage_names[n_filters:-1],
                                                     trace.weights, strict=True)]
               + ["total", trace.stage_names[-1]])
    widths = [2.6] + [1.5] * n_filters + [1.9] * n_scorers + [0.9, 1.4]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    rows = len(trace.endpoints)
    fig, ax = plt.subplots(figsize=(sum(widths) * 0.85, 0.55 * rows + 1.3))
    kinds = ["endpoint"] + ["filter"] * n_filters + ["scorer"] * n_scorers + ["total", "picker"]
    band = {"endpoint": "#FFFFFF", "filter": "#EAF0F8", "scorer": "#FBEFE6",
            "total": "#F2F2F2", "picker": "#E8F4EA"}
    for x, w, header, kind in zip(starts, widths, headers, kinds, strict=True):
        ax.add_patch(Rectangle((x, -0.5), w, rows + 1.2, facecolor=band[kind],
                               edgecolor="white"))
        ax.text(x + w / 2, rows + 0.15, header, ha="center", va="center", fontsize=7,
                fontweight="bold", gid=f"header:{header}")
    for i, endpoint in enumerate(trace.endpoints):
        y = rows - 1 - i
        alive = trace.totals[i] is not None
        color = "black" if alive else "#A0A0A0"
        ax.text(starts[0] + 0.1, y, _describe(endpoint, now), va="center", fontsize=7,
                color=color)
        for f in range(n_filters):
            mark = trace.filters[f][i]
            ax.text(starts[1 + f] + widths[1 + f] / 2, y, mark, ha="center", va="center",
                    fontsize=10, color="#2E7D32" if mark == KEPT else "#C62828",
                    gid=f"filter:{f}:{i}")
        for s in range(n_scorers):
            score = trace.scores[s][i]
            if score is not None:
                ax.text(starts[1 + n_filters + s] + widths[1 + n_filters + s] / 2, y,
                        f"{score:.2f} → {score * trace.weights[s]:.2f}", ha="center",
                        va="center", fontsize=7, gid=f"score:{s}:{i}")
        if alive:
            ax.text(starts[-2] + widths[-2] / 2, y, f"{trace.totals[i]:.2f}", ha="center",
                    va="center", fontsize=8, fontweight="bold", gid=f"total:{i}")
        if endpoint is trace.picked:
            ax.add_patch(Rectangle((0, y - 0.4), sum(widths), 0.8, facecolor="none",
                                   edgecolor="#2E7D32", linewidth=2))
            ax.text(starts[-1] + widths[-1] / 2, y, "picked", ha="center", va="center",
                    fontsize=8, color="#2E7D32", fontweight="bold", gid=f"picked:{i}")
    ax.set_xlim(0, sum(widths))
    ax.set_ylim(-0.6, rows + 0.8)
    ax.axis("off")
    fig.tight_layout()
    return fig


def _describe(endpoint: Endpoint, now: float | None) -> str:
    state = "" if endpoint.routable else (" (ejected)" if not endpoint.healthy else
                                          " (draining)")
    if endpoint.num_requests_waiting is None or endpoint.kv_cache_usage is None:
        return f"{endpoint.url}{state}\nno metrics yet"
    age = "" if now is None else f", {1000 * endpoint.metrics_age_s(now):.0f} ms old"
    return (f"{endpoint.url}{state}\nwaiting {endpoint.num_requests_waiting:g}, "
            f"KV {100 * endpoint.kv_cache_usage:.0f} %{age}")
