"""Prefill and decode on one GPU's roofline
(:doc:`chapter 1 </chapters/ch01_gpu_selection>`: :numref:`fig-roofline`)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from labkit.checks import positive_int
from labkit.hardware import (decode_step, get_gpu, get_model, plan_kv_cache, prefill_step,
                             weight_format)
from labkit.hardware.gpus import GPU
from labkit.hardware.models import ModelSpec
from labkit.hardware.plots import plot_roofline

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def prefill_decode_roofline(model: ModelSpec | str = "Llama-3-8B", gpu: GPU | str = "H100 SXM",
                            prompt_len: int = 2048, context_lens: Sequence[int] = (1024, 4096),
                            batch_sizes: Sequence[int] = DECODE_BATCHES,
                            weight_dtype: str = "bf16") -> Figure:
    """Where a prefill step and decode steps of growing batch sit on ``gpu``'s roofline
    (:numref:`fig-roofline`; chapter 3 batches to move decode right).

    The roof and the prefill point come from :func:`~labkit.hardware.plots.plot_roofline`,
    each decode point from :func:`~labkit.hardware.decode_step`: one line per context
    length, one marker per batch size, at the step's arithmetic intensity and the FLOP rate
    its bound allows. A line stops at the largest batch whose KV cache fits the GPU under
    vLLM's defaults (:func:`~labkit.hardware.plan_kv_cache`), as chapter 1's throughput plot
    does. The dotted line is the ridge point.
    """
    positive_int("prompt_len", prompt_len)
    for context_len in context_lens:
        positive_int("context_lens", context_len)
    spec, gpu = get_model(model), get_gpu(gpu)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    prefill = prefill_step(spec, gpu, prompt_len, weight_dtype=weight_dtype)
    compute_dtype = weight_format(weight_dtype).compute_dtype
    plot_roofline(gpu, {f"prefill, {prompt_len:,} tokens": prefill}, compute_dtype, ax=ax)
    colors = ("tab:orange", "tab:green", "tab:red", "tab:purple")
    for i, context_len in enumerate(context_lens):
        fits = plan_kv_cache(spec, gpu, max_model_len=context_len,
                             weight_dtype=weight_dtype).kv_cache_tokens
        batches = [b for b in batch_sizes if b * context_len <= fits]
        steps = [decode_step(spec, gpu, b, context_len, weight_dtype) for b in batches]
        x = [s.arithmetic_intensity for s in steps]
        y = [s.flops / s.time_s / 1e12 for s in steps]
        color = colors[i % len(colors)]
        ax.plot(x, y, marker="o", markersize=4, color=color, gid=f"decode:{context_len}",
                label=f"decode, context {context_len:,}, batch {batches[0]}..{batches[-1]}")
        # The lines overlap at small batch: label their last points on alternate sides.
        offset, align = ((-6, 6), "right") if i % 2 == 0 else ((6, -12), "left")
        ax.annotate(f"batch {batches[-1]}", (x[-1], y[-1]), textcoords="offset points",
                    xytext=offset, ha=align, fontsize="x-small", color=color)
        if i == 0:
            ax.annotate(f"batch {batches[0]}", (x[0], y[0]), textcoords="offset points",
                        xytext=(-6, 6), ha="right", fontsize="x-small", color=color)
    ax.axvline(gpu.ridge_point(compute_dtype), color="grey", linestyle=":", linewidth=1)
    ax.set_title(f"{spec.name} on {gpu.name}, {weight_dtype} weights", fontsize="medium")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    return fig
