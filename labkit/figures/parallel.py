"""Tensor parallelism drawn: the Megatron MLP split and the ring all-reduce
(:ref:`ch03-tensor-parallelism`)."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from labkit.checks import in_range, positive_int
from labkit.hardware import get_model, tp_shard
from labkit.hardware.models import ModelSpec

_RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
                "#DA8BC3", "#8C8C8C")


def tensor_parallel_mlp_figure(model: ModelSpec | str = "Llama-3-8B",
                               tensor_parallel_size: int = 4) -> Figure:
    """The MLP of one decoder layer split over ``tensor_parallel_size`` GPUs
    (:ref:`ch03-tensor-parallelism`).

    Top: the full weights, ``W_gate`` and ``W_up`` cut by output columns, ``W_down`` by input
    rows, one colour per GPU. Below, one lane per GPU: the replicated input ``x``, its column
    shards, the SwiGLU activations it computes alone, its row shard of ``W_down`` and the
    partial sum that the all-reduce adds up, so every GPU ends with the whole output. The
    shapes are the model's (``hidden_size``, ``intermediate_size``), each GPU's share from
    :func:`~labkit.hardware.tp_shard`, which refuses a TP size that does not divide the width
    as vLLM does; ``T`` is the number of tokens in the step.
    """
    tp = in_range("tensor_parallel_size", positive_int("tensor_parallel_size",
                                                         tensor_parallel_size), 2, 8)
    spec = get_model(model)
    hidden, inter = spec.hidden_size, spec.intermediate_size
    shard = tp_shard(inter, tp, "intermediate_size")
    fig, ax = plt.subplots(figsize=(11, 2.6 + 0.75 * tp))

    # The full matrices, cut into per-GPU strips.
    top = 0.9 * tp + 0.6
    ax.text(0.0, top + 1.55, f"{spec.name}: hidden_size {hidden:,}, intermediate_size "
            f"{inter:,}, tensor_parallel_size {tp}", fontsize=9, fontweight="bold")
    for r in range(tp):
        ax.add_patch(Rectangle((0.2 + 3.0 * r / tp, top), 3.0 / tp, 1.2,
                               facecolor=_RANK_COLORS[r], edgecolor="white", alpha=0.8))
        ax.add_patch(Rectangle((6.2, top + 1.2 - 1.2 * (r + 1) / tp), 1.6, 1.2 / tp,
                               facecolor=_RANK_COLORS[r], edgecolor="white", alpha=0.8))
    ax.text(3.35, top + 0.6, f"W_gate, W_up\n[{hidden:,} × {inter:,}] each\nsplit by columns",
            fontsize=8, va="center", gid="full:gate_up")
    ax.text(8.0, top + 0.6, f"W_down\n[{inter:,} × {hidden:,}]\nsplit by rows", fontsize=8,
            va="center", gid="full:down")

    # One lane per GPU: x -> column shards -> SwiGLU -> row shard -> partial sum.
    columns = [(0.0, "x", f"[T × {hidden:,}]", "replicated"),
               (2.0, "W_gate, W_up", f"[{hidden:,} × {shard:,}]", "columns"),
               (4.3, "h = SwiGLU", f"[T × {shard:,}]", "no exchange"),
               (6.5, "W_down", f"[{shard:,} × {hidden:,}]", "rows"),
               (8.8, "partial y", f"[T × {hidden:,}]", "")]
    for r in range(tp):
        y = 0.9 * (tp - 1 - r)
        ax.text(-0.15, y + 0.3, f"GPU {r}", ha="right", va="center", fontsize=9,
                color=_RANK_COLORS[r], fontweight="bold")
        for i, (x, name, shape, _) in enumerate(columns):
            ax.add_patch(Rectangle((x, y), 1.8, 0.6, facecolor=_RANK_COLORS[r],
                                   alpha=0.15 if i in (0, 4) else 0.5, edgecolor=_RANK_COLORS[r]))
            ax.text(x + 0.9, y + 0.3, f"{name}\n{shape}", ha="center", va="center",
                    fontsize=7, gid=f"lane:{r}:{i}")
            if i:
                ax.add_patch(FancyArrowPatch((columns[i - 1][0] + 1.8, y + 0.3), (x, y + 0.3),
                                             arrowstyle="->", mutation_scale=8))
        ax.add_patch(FancyArrowPatch((10.6, y + 0.3), (11.3, 0.45 * (tp - 1) + 0.3),
                                     arrowstyle="->", mutation_scale=8, color="grey"))
    for x, _, _, note in columns:
        if note:
            ax.text(x + 0.9, -0.35, note, ha="center", fontsize=7, style="italic")
    middle = 0.45 * (tp - 1)
    ax.add_patch(Rectangle((11.3, middle - 0.1), 1.5, 0.8, facecolor="#F2F2F2",
                           edgecolor="black"))
    ax.text(12.05, middle + 0.3, f"all-reduce\n(sum over\n{tp} GPUs)", ha="center",
            va="center", fontsize=8, gid="all-reduce")
    ax.text(13.0, middle + 0.3, f"y [T × {hidden:,}]\non every GPU", va="center", fontsize=8)
    ax.set_xlim(-1.0, 15.0)
    ax.set_ylim(-0.6, top + 1.8)
    ax.axis("off")
    fig.tight_layout()
    return fig


@dataclass(frozen=True)
class RingStep:
    """The state of a ring all-reduce after one step (:ref:`ch03-tensor-parallelism`).

    ``sends`` lists ``(from_rank, to_rank, chunk)`` for this step (empty for the starting
    state). ``holdings[rank][chunk]`` is the set of ranks whose values that rank's copy of
    the chunk sums: ``{rank}`` at the start, every rank once it is fully reduced.
    """

    phase: str  # "start", "reduce-scatter" or "all-gather"
    index: int  # 1-based within its phase (0 for the start)
    sends: tuple[tuple[int, int, int], ...]
    holdings: tuple[tuple[frozenset[int], ...], ...]

    def complete(self, rank: int) -> list[int]:
        """The chunks ``rank`` holds fully reduced after this step."""
        everyone = len(self.holdings)
        return [c for c, held in enumerate(self.holdings[rank]) if len(held) == everyone]


def ring_all_reduce_steps(num_ranks: int) -> list[RingStep]:
    """Every step of a ring all-reduce over ``num_ranks`` ranks, each buffer in as many chunks
    (:ref:`ch03-tensor-parallelism`; :func:`~labkit.parallel.ring_all_reduce_s` prices it).

    Reduce-scatter, ``p - 1`` steps: at step ``s`` (from 0) rank ``r`` sends its chunk
    ``(r - s) mod p`` to rank ``r + 1``, which adds it to its own. After it, rank ``r`` holds
    chunk ``(r + 1) mod p`` summed over all ranks. All-gather, ``p - 1`` more steps: rank
    ``r`` sends chunk ``(r + 1 - s) mod p`` on, and the receiver keeps it. Every rank sends
    one chunk per step, ``2 (p - 1)`` chunks of ``1/p`` of the buffer in all.
    """
    p = positive_int("num_ranks", num_ranks, at_least=2)
    holdings = [[frozenset({r}) for _ in range(p)] for r in range(p)]
    steps = [RingStep("start", 0, (), tuple(tuple(h) for h in holdings))]
    for phase, first_chunk in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(p - 1):
            sends = tuple((r, (r + 1) % p, (r + first_chunk - s) % p) for r in range(p))
            # All sends of a step happen at once: read every message before any is applied.
            messages = [(dst, chunk, holdings[src][chunk]) for src, dst, chunk in sends]
            for dst, chunk, held in messages:
                holdings[dst][chunk] = (holdings[dst][chunk] | held if phase == "reduce-scatter"
                                        else held)
            steps.append(RingStep(phase, s + 1, sends, tuple(tuple(h) for h in holdings)))
    return steps


def ring_all_reduce_figure(num_ranks: int = 4) -> Figure:
    """The ring all-reduce step by step (:ref:`ch03-tensor-parallelism`), from
    :func:`ring_all_reduce_steps`.

    One row per step, one column per rank; in each cell the rank's ``p`` chunks, shaded by
    how many ranks' values each already sums and labelled with those ranks ("Σ" when all).
    The chunk each rank received from its neighbour in that step (and added to its own, or
    in the all-gather kept) is outlined in red.
    """
    steps = ring_all_reduce_steps(num_ranks)
    p = num_ranks
    fig, ax = plt.subplots(figsize=(2.2 * p + 2.5, 0.62 * len(steps) + 0.9))
    for row, step in enumerate(steps):
        y = len(steps) - 1 - row
        title = "start" if step.phase == "start" else f"{step.phase} {step.index}"
        ax.text(-0.2, y + 0.3, title, ha="right", va="center", fontsize=8)
        received = {(dst, chunk) for _, dst, chunk in step.sends}
        for rank in range(p):
            for chunk in range(p):
                held = step.holdings[rank][chunk]
                x = rank * (p + 1) + chunk
                # Its own colour once complete; before, grey that darkens as it sums more.
                face = (_RANK_COLORS[chunk % len(_RANK_COLORS)] if len(held) == p
                        else plt.cm.Greys(0.15 + 0.5 * len(held) / p))
                outline = ("red", 2.0) if (rank, chunk) in received else ("black", 0.5)
                ax.add_patch(Rectangle((x, y), 0.9, 0.6, facecolor=face, edgecolor=outline[0],
                                       linewidth=outline[1],
                                       gid=f"chunk:{row}:{rank}:{chunk}"))
                label = "Σ" if len(held) == p else "+".join(str(i) for i in sorted(held))
                ax.text(x + 0.45, y + 0.3, label, ha="center", va="center", fontsize=7)
    for rank in range(p):
        ax.text(rank * (p + 1) + p / 2 - 0.05, len(steps) - 0.1, f"rank {rank}", ha="center",
                fontsize=9, fontweight="bold")
        ax.text(rank * (p + 1) + p / 2 - 0.05, -0.35,
                "chunks " + " ".join(str(c) for c in range(p)), ha="center", fontsize=6)
    ax.set_xlim(-2.6, p * (p + 1))
    ax.set_ylim(-0.6, len(steps) + 0.2)
    ax.axis("off")
    ax.set_title(f"ring all-reduce over {p} ranks: rank r sends to rank r+1 (mod {p}); "
                 f"red: the chunk each rank received in that step", fontsize=8)
    fig.tight_layout()
    return fig
