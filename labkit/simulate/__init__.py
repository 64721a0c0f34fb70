"""A serving simulator (:ref:`ch03-simulating`).

- :mod:`~labkit.simulate.workload`: :class:`Workload`, the one record of requests to send
  (arrival times, prompt and output lengths) and its views; gamma/Poisson arrivals, length
  distributions, vLLM's random-dataset rule, shared-prefix conversations;
  :mod:`~labkit.simulate.traces`: production traces replayed (two of Azure's ship with it).
- :class:`RooflineCost`: chapter 1's roofline as the step-cost model;
  :class:`~labkit.simulate.deployment.Deployment`: one replica (model, GPUs, precision, vLLM's
  KV cache and scheduler defaults), the record chapters 5 and 6 simulate (imported on its own:
  it brings chapter 3's tensor-parallel model).
- :func:`simulate`: the discrete-event loop, step by step or, by default, on the fast path
  (:mod:`~labkit.simulate.fast`, the same result); :func:`summarize`: vLLM's benchmark metrics.
"""

from labkit.simulate.cost import RooflineCost, StepCostModel
from labkit.simulate.metrics import (BenchmarkResult, RequestLatencies, summarize,
                                     summarize_latencies)
from labkit.simulate.records import SimulationResult, StepRecord
from labkit.simulate.simulator import simulate, sweep
from labkit.simulate.traces import TRACES, interarrival_cv, load_trace
from labkit.simulate.workload import (BenchRequest, Workload, arrival_times, multi_turn_workload,
                                      random_dataset, random_length_bounds, random_lengths,
                                      sample_lengths, shared_prefix_dataset)

__all__ = ["BenchRequest", "BenchmarkResult", "RequestLatencies", "RooflineCost",
           "SimulationResult", "StepCostModel", "StepRecord", "TRACES", "Workload",
           "arrival_times", "interarrival_cv", "load_trace", "multi_turn_workload",
           "random_dataset", "random_length_bounds", "random_lengths", "sample_lengths",
           "shared_prefix_dataset", "simulate", "summarize", "summarize_latencies", "sweep"]
