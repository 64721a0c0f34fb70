"""Speculative decoding: tokens per step against the acceptance rate, and the speed-up
against concurrency, measured and predicted (:ref:`ch09-why-it-works`, :ref:`ch09-at-scale`).

The curves come from :mod:`labkit.simulate.speculation` (the papers' expectation and chapter
1's roofline); the points are what a server measured through its ``vllm:spec_decode_*``
counters, handed in as numbers so that this module depends on no running engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from labkit.checks import ParameterError, positive_int
from labkit.hardware import GPU, ModelSpec, get_gpu, get_model, plan_kv_cache
from labkit.simulate.speculation import expected_tokens_per_step, speculative_decode_gain

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def tokens_per_step_figure(ks: Sequence[int] = (1, 2, 4, 8),
                           measured: Mapping[str, tuple[float, float]] | None = None) -> Figure:
    """Mean tokens a verification step emits per request against the acceptance rate, one
    curve per number of drafts ``k`` (:ref:`ch09-why-it-works`).

    ``measured`` maps a label to a server's (acceptance rate, mean acceptance length): its
    draft acceptance rate and ``1 + accepted / drafts``, vLLM's two figures. A point below the
    curve of its ``k`` means steps with fewer than ``k`` drafts (n-gram lookup found no
    match) or rejections that come in runs.
    """
    for k in ks:
        positive_int("ks", k)
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    rates = np.linspace(0, 1, 101)
    for k in ks:
        ax.plot(rates, [expected_tokens_per_step(a, k) for a in rates], label=f"k = {k}",
                gid=f"k:{k}")
    for label, (rate, length) in (measured or {}).items():
        ax.plot([rate], [length], marker="o", linestyle="none", color="black", gid=label)
        ax.annotate(label, (rate, length), textcoords="offset points", xytext=(-6, 6),
                    ha="right", fontsize="small")
    ax.set_xlabel("acceptance rate of a draft token")
    ax.set_ylabel("tokens per verification step")
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=1)
    ax.grid(alpha=0.3)
    ax.legend(title="drafts per step", fontsize="small")
    fig.tight_layout()
    return fig


def speedup_figure(measured: Mapping[str, Sequence[tuple[int, float]]], measured_label: str,
                   acceptance_rate: float, num_speculative_tokens: int,
                   model: ModelSpec | str = "Llama-3-8B", gpu: GPU | str = "H100 SXM",
                   context_lens: Sequence[int] = (256, 4096),
                   batch_sizes: Sequence[int] = BATCHES) -> Figure:
    """Speed-up from speculation against concurrency: measured on the server that ran
    (left), predicted by chapter 1's roofline for ``model`` on ``gpu`` at the same acceptance
    rate and drafts (right) (:ref:`ch09-at-scale`).

    ``measured`` maps a workload to its (concurrency, speed-up) points. On the right, one
    line per context length, up to the largest batch whose KV cache fits ``gpu`` under vLLM's
    defaults (:func:`~labkit.hardware.plan_kv_cache`), drafts' slots included; the dotted line
    at 1 is where speculation stops paying.
    """
    if not measured:
        raise ParameterError("measured", "measured must hold at least one workload's points")
    spec, gpu = get_model(model), get_gpu(gpu)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0), sharey=False)
    for workload, points in measured.items():
        points = sorted(points)
        left.plot([c for c, _ in points], [s for _, s in points], marker="o", label=workload,
                  gid=f"measured:{workload}")
    left.set_title(measured_label, fontsize="medium")
    left.set_xlabel("requests at once")
    left.set_xscale("log", base=2)
    for context_len in context_lens:
        fits = plan_kv_cache(spec, gpu, max_model_len=context_len).kv_cache_tokens
        batches = [b for b in batch_sizes if b * (context_len + num_speculative_tokens) <= fits]
        if not batches:
            raise ParameterError("context_lens", f"context_lens: one sequence of "
                                 f"{context_len:,} tokens does not fit {gpu.name}'s KV cache")
        gains = [speculative_decode_gain(spec, gpu, b, context_len, num_speculative_tokens,
                                         acceptance_rate) for b in batches]
        right.plot(batches, [g.speedup for g in gains], marker=".",
                   label=f"context {context_len:,}", gid=f"predicted:{context_len}")
    right.set_title(f"predicted: {spec.name} on {gpu.name}, acceptance "
                    f"{acceptance_rate:.0%}, k = {num_speculative_tokens}", fontsize="medium")
    right.set_xlabel("batch size (sequences per step)")
    right.set_xscale("log", base=2)
    for ax in (left, right):
        ax.axhline(1, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel("speed-up (tokens/s with / without)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
