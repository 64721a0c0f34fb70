"""A serving simulator (:ref:`ch03-simulating`).

- :mod:`~labkit.simulate.workload`: gamma/Poisson arrivals, length distributions,
  shared-prefix conversations, trace replay.
- :class:`RooflineCost`: chapter 1's roofline as the step-cost model.
- :func:`simulate`: the discrete-event loop, step by step or, by default, on the fast path
  (:mod:`~labkit.simulate.fast`, the same result); :func:`summarize`: vLLM's benchmark metrics.
"""

from labkit.simulate.cost import RooflineCost, StepCostModel
from labkit.simulate.metrics import (BenchmarkResult, RequestLatencies, summarize,
                                     summarize_latencies)
from labkit.simulate.records import SimulationResult, StepRecord
from labkit.simulate.simulator import simulate, sweep
from labkit.simulate.workload import (arrival_times, load_trace, multi_turn_workload,
                                      random_workload, sample_lengths)

__all__ = ["BenchmarkResult", "RequestLatencies", "RooflineCost", "SimulationResult",
           "StepCostModel", "StepRecord", "arrival_times", "load_trace", "multi_turn_workload",
           "random_workload", "sample_lengths", "simulate", "summarize", "summarize_latencies",
           "sweep"]
