"""Static against continuous batching, step by step, from real scheduler runs
(:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`:
:numref:`fig-batching-timeline`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from labkit.checks import ParameterError, positive_int
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig, StaticBatchScheduler

# What a request does in one step. A request that has not arrived or has left draws nothing.
NOT_ARRIVED = "not arrived"
WAITING = "waiting"
PREFILL = "prefill"
DECODE = "decode"
PADDING = "padding"        # finished, but its static batch still runs: a wasted row
PREEMPTED = "preempted"    # its blocks were taken back this step; it will recompute
FINISHED = "finished"

STATE_COLORS = {WAITING: "#D9D9D9", PREFILL: "#DD8452", DECODE: "#4C72B0",
                PADDING: "#F2C6C6", PREEMPTED: "#C44E52"}


@dataclass(frozen=True)
class BatchTimeline:
    """What every request did at every step of one scheduler run (chapter 3).

    ``states[i][s]`` is request ``request_ids[i]``'s state at step ``s`` (one of the module's
    state names); ``num_tokens[s]`` is how many tokens step ``s`` computed, padding excluded.
    """

    name: str
    request_ids: tuple[str, ...]
    states: tuple[tuple[str, ...], ...]
    num_tokens: tuple[int, ...]

    @property
    def num_steps(self) -> int:
        """Steps of the run, idle ones before the first arrival included."""
        return len(self.num_tokens)

    def count(self, state: str) -> int:
        """Cells in ``state`` over all requests and steps."""
        return sum(row.count(state) for row in self.states)


def record_timeline(scheduler: Scheduler | StaticBatchScheduler, requests: Sequence[Request],
                    arrival_steps: Sequence[int], name: str,
                    max_steps: int = 10_000) -> BatchTimeline:
    """Run ``scheduler`` step by step and record each request's state (chapter 3).

    Request ``i`` is added before step ``arrival_steps[i]``. A scheduled request is in
    prefill while it computes tokens it already knows (its prompt, or everything again after a
    preemption) and in decode when it computes its one newest token; a request of a static
    batch that has finished while the batch runs on is padding. Stops when every request has
    finished; raises ``ParameterError`` past ``max_steps``.
    """
    if len(requests) != len(arrival_steps):
        raise ParameterError("arrival_steps", "arrival_steps must give one step per request")
    for step in arrival_steps:
        positive_int("arrival_steps", step, at_least=0)
    pending = sorted(zip(arrival_steps, range(len(requests)), strict=True))
    arrived: set[str] = set()
    columns: list[list[str]] = []
    num_tokens: list[int] = []
    step = 0
    while pending or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise ParameterError("max_steps", f"the run needs more than {max_steps} steps")
        while pending and pending[0][0] <= step:
            request = requests[pending.pop(0)[1]]
            scheduler.add_request(request)
            arrived.add(request.request_id)
        out = scheduler.schedule()
        preempted = {r.request_id for r in out.preempted}
        # Only a static batch keeps finished requests in it (as padding rows).
        in_batch = {r.request_id for r in getattr(scheduler, "batch", ())}
        column = []
        for request in requests:
            rid = request.request_id
            scheduled = out.num_scheduled_tokens.get(rid)
            if rid not in arrived:
                column.append(NOT_ARRIVED)
            elif rid in preempted:
                column.append(PREEMPTED)
            elif scheduled is not None:
                # Before update(), num_computed_tokens counts what earlier steps computed.
                newest_only = (scheduled == 1 and request.num_computed_tokens
                               == request.num_tokens - 1 >= request.prompt_len)
                column.append(DECODE if newest_only else PREFILL)
            elif request.is_finished:
                column.append(PADDING if rid in in_batch else FINISHED)
            else:
                column.append(WAITING)
        columns.append(column)
        num_tokens.append(out.total_num_scheduled_tokens)
        scheduler.update(out, float(step + 1))
        step += 1
    states = tuple(tuple(column[i] for column in columns) for i in range(len(requests)))
    return BatchTimeline(name, tuple(r.request_id for r in requests), states,
                         tuple(num_tokens))


def compare_batching(prompt_lens: Sequence[int], output_lens: Sequence[int],
                     arrival_steps: Sequence[int], max_num_seqs: int = 4,
                     max_num_batched_tokens: int = 64, block_size: int = 16,
                     num_blocks: int = 256) -> list[BatchTimeline]:
    """The same requests through :class:`~labkit.scheduling.StaticBatchScheduler` (batches of
    ``max_num_seqs``) and :class:`~labkit.scheduling.Scheduler` (``max_num_seqs`` running,
    ``max_num_batched_tokens`` per step, chunked prefill), for :numref:`fig-batching-timeline`.

    Token ids are made up (distinct per request, so no prefix is shared); the KV cache has
    ``num_blocks`` blocks of ``block_size`` tokens.
    """
    def requests() -> list[Request]:
        return [Request(f"r{i}", [1000 * (i + 1) + t for t in range(p)],
                        output_plan=list(range(o)), arrival_time=float(step))
                for i, (p, o, step) in enumerate(zip(prompt_lens, output_lens, arrival_steps,
                                                      strict=True))]

    static = StaticBatchScheduler(KVCacheManager(num_blocks, block_size), max_num_seqs)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    continuous = Scheduler(KVCacheManager(num_blocks, block_size), config)
    return [record_timeline(static, requests(), arrival_steps, "static batching"),
            record_timeline(continuous, requests(), arrival_steps, "continuous batching")]


def batching_figure(timelines: Sequence[BatchTimeline]) -> Figure:
    """One panel per run: requests as rows, engine steps as columns (chapter 3).

    Each cell is coloured by what the request did in that step: waiting, prefill, decode,
    padding (a finished request its static batch still carries) or preempted. The panels
    share the step axis, so the shorter run finishes visibly earlier.
    """
    if not timelines:
        raise ParameterError("timelines", "timelines must hold at least one run")
    rows = max(len(t.request_ids) for t in timelines)
    fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                             figsize=(10, 0.6 + 0.32 * rows * len(timelines) + 0.5))
    for ax, timeline in zip(axes[:, 0], timelines, strict=True):
        for row, (rid, states) in enumerate(zip(timeline.request_ids, timeline.states,
                                                strict=True)):
            for state, color in STATE_COLORS.items():
                spans = _runs(states, state)
                if spans:
                    ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color,
                                   edgecolor="white", linewidth=0.5, gid=f"{rid}:{state}")
        ax.set_yticks(range(len(timeline.request_ids)), timeline.request_ids, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{timeline.name}: {timeline.num_steps} steps", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("engine step")
    axes[-1, 0].set_xlim(0, max(t.num_steps for t in timelines))
    handles = [Patch(facecolor=c, label=s) for s, c in STATE_COLORS.items()
               if any(t.count(s) for t in timelines)]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _runs(states: Sequence[str], state: str) -> list[tuple[int, int]]:
    """``(first_step, length)`` of each run of consecutive steps in ``state``."""
    spans: list[tuple[int, int]] = []
    for step, s in enumerate(states):
        if s != state:
            continue
        if spans and spans[-1][0] + spans[-1][1] == step:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((step, 1))
    return spans
