"""Plots for :ref:`ch03-simulating`: memory over time, latency distributions, the rate sweep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from labkit.simulate.metrics import BenchmarkResult, RequestLatencies
from labkit.simulate.records import SimulationResult


def plot_kv_usage(results: Mapping[str, SimulationResult], ax=None):
    """KV-cache usage (and preemptions, as marks) over simulated time, one line per run."""
    ax = ax or plt.subplots(figsize=(8, 3.5))[1]
    for label, result in results.items():
        t = [s.end_s for s in result.steps]
        usage = [100 * s.kv_cache_usage for s in result.steps]
        (line,) = ax.plot(t, usage, label=label, linewidth=1)
        preempted = [s for a, s in zip(result.steps, result.steps[1:], strict=False)
                     if s.num_preemptions > a.num_preemptions]
        if preempted:
            ax.scatter([s.end_s for s in preempted], [100 * s.kv_cache_usage for s in preempted],
                       marker="x", color=line.get_color(), label=f"{label}: preemption")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV cache usage (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize="small")
    return ax


def plot_latency_cdfs(results: Mapping[str, SimulationResult], axes=None):
    """Cumulative distributions of TTFT and TPOT per run."""
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.5))[1]
    for label, result in results.items():
        latencies = [RequestLatencies.of(r) for r in result.requests]
        for ax, values in zip(axes, ([m.ttft_ms for m in latencies],
                                     [m.tpot_ms for m in latencies if m.output_len > 1]),
                              strict=True):
            values = np.sort(values)
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize="small")
    return axes


def plot_rate_sweep(sweeps: Mapping[str, Sequence[tuple[float, BenchmarkResult]]], axes=None):
    """Output throughput and median TTFT against the offered request rate."""
    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.5))[1]
    for label, points in sweeps.items():
        rates = [rate for rate, _ in points]
        axes[0].plot(rates, [s.output_throughput for _, s in points], marker="o", label=label)
        axes[1].plot(rates, [s.median_ttft_ms for _, s in points], marker="o", label=label)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("median TTFT (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("offered load (requests/s)")
        ax.legend(fontsize="small")
    return axes
