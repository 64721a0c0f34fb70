"""Figures for the book, drawn at build time from labkit's own data structures and runs.

Each function returns a :class:`matplotlib.figure.Figure` and names, in its docstring, the
chapter section it illustrates. A figure is drawn from the real thing: the engine loop from a
real engine's parts, the block table from a :class:`~labkit.kvcache.KVCacheManager` after
real allocations, the batching timeline from a real scheduler run, the roofline from
:mod:`labkit.hardware`'s bounds, the router's stages from a real
:class:`~labkit.gateway.routing.Pipeline`, the autoscaler loop from a real
:class:`~labkit.autoscale.HorizontalPodAutoscaler`. Nothing in a figure is typed in by hand.

- :mod:`~labkit.figures.roofline`: prefill and decode on one GPU's roofline
  (:numref:`fig-roofline`).
- :mod:`~labkit.figures.engine`: the five parts of an inference engine in a loop
  (:numref:`fig-engine-loop`).
- :mod:`~labkit.figures.kvcache`: the block table, logical to physical blocks
  (:ref:`ch03-paged-attention`).
- :mod:`~labkit.figures.batching`: static against continuous batching, step by step
  (:numref:`fig-batching-timeline`).
- :mod:`~labkit.figures.parallel`: the Megatron MLP split and the ring all-reduce
  (:ref:`ch03-tensor-parallelism`).
- :mod:`~labkit.figures.gateway`: the endpoint picker's filter, score, pick
  (:ref:`ch05-choosing-backend`).
- :mod:`~labkit.figures.autoscale`: the HPA's observe, decide, stabilize, scale loop
  (:ref:`ch05-hpa-kpa-keda`).
"""
