"""Plots for chapter 1: memory breakdowns (:ref:`ch01-what-fits`), the roofline and decode
throughput (:doc:`chapter 1 </chapters/ch01_gpu_selection>`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from labkit.hardware.gpus import GPU, get_gpu
from labkit.hardware.kv_budget import DoesNotFitError, plan_kv_cache
from labkit.hardware.memory import MemoryEstimate
from labkit.hardware.models import ModelSpec
from labkit.hardware.roofline import StepBound, decode_step

_PARTS = (("weights", "weights_gib"), ("KV cache", "kv_cache_gib"),
          ("activations", "activations_gib"), ("runtime overhead", "overhead_gib"))


def plot_memory_breakdown(estimates: list[MemoryEstimate], gpu: GPU | str | None = None,
                          ax=None):
    """Stacked bars of weights / KV / activations / overhead, with a GPU's memory as a line."""
    ax = ax or plt.subplots(figsize=(8, 4))[1]
    labels = [f"{e.model}\n{e.weight_dtype}, TP={e.tensor_parallel_size}" for e in estimates]
    bottom = np.zeros(len(estimates))
    for label, attr in _PARTS:
        values = np.array([getattr(e, attr) for e in estimates])
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom += values
    if gpu is not None:
        gpu = get_gpu(gpu)
        ax.axhline(gpu.memory_gib, color="black", linestyle="--", label=f"{gpu.name} memory")
    ax.set_ylabel("GiB per GPU")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", labelsize="small")
    return ax


def plot_roofline(gpu: GPU | str, steps: dict[str, StepBound] | None = None,
                  compute_dtype: str = "bf16", ax=None):
    """The roofline of ``gpu`` (log-log), with named engine steps placed on it."""
    gpu = get_gpu(gpu)
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    peak = gpu.peak_ops_s(compute_dtype) / 1e12
    ridge = gpu.ridge_point(compute_dtype)
    intensity = np.logspace(-1, 5, 200)
    roof = np.minimum(peak, intensity * gpu.mem_bandwidth_gb_s / 1e3)
    ax.loglog(intensity, roof, color="black",
              label=f"{gpu.name} {compute_dtype}: ridge at {ridge:.0f} FLOP/byte")
    for name, step in (steps or {}).items():
        achieved = step.flops / step.time_s / 1e12
        ax.scatter(step.arithmetic_intensity, achieved, zorder=3)
        ax.annotate(name, (step.arithmetic_intensity, achieved), textcoords="offset points",
                    xytext=(5, -12), fontsize="small")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.legend(fontsize="small", loc="lower right")
    return ax


def plot_decode_throughput(model: ModelSpec | str, gpus: list[GPU | str], context_len: int,
                           batch_sizes=None, weight_dtype: str = "bf16", ax=None):
    """Decode tokens/s bound vs batch size for several GPUs: where batching stops paying.

    Each curve ends at the largest batch whose KV cache fits the GPU under vLLM's defaults
    (:func:`~labkit.hardware.kv_budget.plan_kv_cache`); a GPU the model does not fit is left out.
    """
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    batch_sizes = batch_sizes if batch_sizes is not None else [2**i for i in range(11)]
    left_out = []
    for gpu in gpus:
        gpu = get_gpu(gpu)
        try:
            plan = plan_kv_cache(model, gpu, max_model_len=context_len, weight_dtype=weight_dtype)
        except DoesNotFitError:
            left_out.append(gpu.name)
            continue
        fitting = [b for b in batch_sizes if b * context_len <= plan.kv_cache_tokens]
        tok_s = [decode_step(model, gpu, b, context_len, weight_dtype).tokens_per_s
                 for b in fitting]
        ax.loglog(fitting, tok_s, marker="o", label=gpu.name)
    ax.set_xlabel("decode batch size (sequences)")
    ax.set_ylabel("tokens/s upper bound")
    title = f"context {context_len:,} tokens, {weight_dtype} weights"
    if left_out:
        title += f"\n(does not fit: {', '.join(left_out)})"
    ax.set_title(title, fontsize="medium")
    if ax.lines:
        ax.legend(fontsize="small")
    return ax
