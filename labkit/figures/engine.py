"""The five parts of an inference engine, labelled from a real engine
(:doc:`chapter 2 </chapters/ch02_engines>`: :numref:`fig-engine-loop`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling import sample


def engine_loop_figure(engine: LLMEngine) -> Figure:
    """Tokenizer, scheduler, KV cache manager, model runner and sampler, and what passes
    between them in one step (:numref:`fig-engine-loop`).

    Every box is labelled from ``engine`` itself: the classes it runs and their settings
    (vocabulary, ``max_num_seqs``, ``max_num_batched_tokens``, the KV cache's blocks, the
    model's layers). The loop closes at the scheduler: each sampled token joins its request,
    and the next step is scheduled with it.
    """
    spec, config, kv = engine.model.spec, engine.scheduler.config, engine.kv_cache
    x_tok, x_sched, x_model, x_sample = 0.0, 3.5, 7.0, 10.5
    boxes = {
        "tokenizer": (x_tok, 2.0, f"{type(engine.tokenizer).__name__}\n"
                                  f"{engine.vocab_size:,}-token vocabulary"),
        "scheduler": (x_sched, 2.0, f"{type(engine.scheduler).__name__}\n"
                                    f"max_num_seqs {config.max_num_seqs}\n"
                                    f"max_num_batched_tokens {config.max_num_batched_tokens:,}"),
        "KV cache manager": (x_sched, 0.0, f"{type(kv).__name__}\n{kv.num_blocks:,} blocks of "
                                           f"{kv.block_size} tokens\nprefix caching "
                                           f"{'on' if kv.enable_prefix_caching else 'off'}"),
        "model runner": (x_model, 2.0, f"{type(engine.model).__name__}\n{spec.num_layers} "
                                       f"layers, hidden {spec.hidden_size:,}"),
        "sampler": (x_sample, 2.0, f"{sample.__module__}\n.{sample.__name__}: one token "
                                   f"per sequence"),
    }
    width, height = 2.4, 1.1
    fig, ax = plt.subplots(figsize=(12, 4))
    for name, (x, y, body) in boxes.items():
        ax.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.05",
                                    facecolor="#EAF0F8", edgecolor="#4C72B0"))
        ax.text(x + width / 2, y + height - 0.2, name, ha="center", va="center", fontsize=9,
                fontweight="bold")
        ax.text(x + width / 2, y + 0.4, body, ha="center", va="center", fontsize=7,
                gid=f"box:{name}")

    def arrow(start, end, label, label_xy, **style):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="->", mutation_scale=10, **style))
        ax.text(*label_xy, label, ha="center", va="center", fontsize=7, color="dimgrey",
                gid=f"flow:{label}")

    mid, below = 2.0 + height / 2, 2.0 + height / 2 - 0.35
    arrow((-1.0, mid), (x_tok, mid), "prompt\ntext", (-0.5, below))
    arrow((x_tok + width, mid), (x_sched, mid), "token ids", (x_sched - 0.55, below))
    arrow((x_sched + width, mid), (x_model, mid), "new tokens\nper request",
          (x_model - 0.55, below))
    arrow((x_sched + width / 2 - 0.3, 2.0), (x_sched + width / 2 - 0.3, height),
          "allocate\nslots", (x_sched + width / 2 - 0.85, 1.55))
    arrow((x_sched + width / 2 + 0.3, height), (x_sched + width / 2 + 0.3, 2.0),
          "block\ntables", (x_sched + width / 2 + 0.85, 1.55))
    arrow((x_model + width, mid), (x_sample, mid), "logits,\na row per\nsequence",
          (x_sample - 0.55, below - 0.1))
    arrow((x_sample + width / 2, 2.0 + height), (x_sched + width / 2, 2.0 + height),
          "each sampled token joins its request: the next step", (7.2, 3.95),
          connectionstyle="arc3,rad=0.2")
    arrow((x_sample + width / 2, 2.0), (x_sample + width / 2, 0.6),
          "text, detokenized\nand streamed", (x_sample + width / 2 + 0.85, 1.3))
    ax.set_xlim(-1.2, 13.2)
    ax.set_ylim(-0.2, 4.2)
    ax.axis("off")
    fig.tight_layout()
    return fig
