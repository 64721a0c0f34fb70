"""Autoscaling an inference fleet (chapter 5: :ref:`ch05-autoscaling-signal`,
:ref:`ch05-hpa-kpa-keda`).

- policies on an injected clock, one module each: :mod:`~labkit.autoscale.threshold` (the
  tutorial's thresholds with the clock fixed), :mod:`~labkit.autoscale.hpa` (Kubernetes'
  HPA), :mod:`~labkit.autoscale.knative` (Knative's KPA), :mod:`~labkit.autoscale.keda`
  (KEDA's activation); :mod:`~labkit.autoscale.observation`, what they all read.
- :mod:`~labkit.autoscale.simulate`: chapter 3's simulated servers as a fleet with cold
  starts, driven by bursty and diurnal traces (each a :class:`labkit.simulate.Workload`);
  p99 TTFT, SLO attainment, replica-hours.
- :mod:`~labkit.autoscale.controller`: the same loop for real, on one machine: it starts and
  stops ``labkit serve`` processes behind :mod:`labkit.gateway`, scaling on their scraped
  metrics and draining before it stops one (needs the ``serve`` extra).
- :mod:`~labkit.autoscale.manifests`: the production path, an HPA and a KEDA ScaledObject on
  ``vllm:num_requests_waiting``, generated and validated (needs the ``gateway`` extra).
"""

from labkit.autoscale.hpa import (DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, HPADecision,
                                  HPAScalingPolicy, HPAScalingRules, HorizontalPodAutoscaler)
from labkit.autoscale.keda import KedaAutoscaler
from labkit.autoscale.knative import KPADecision, KnativePodAutoscaler
from labkit.autoscale.observation import (CONCURRENCY, GPU_UTILIZATION, KV_CACHE_USAGE, RUNNING,
                                          WAITING, Observation, PodMetrics, Policy)
from labkit.autoscale.threshold import (GPUMetric, ScaleEvent, ThresholdPolicy, ThresholdRule,
                                        demo_metric, threshold_demo)
from labkit.autoscale.simulate import (CLEAN_POD_START_S, COLD_START_S, COLD_START_STEPS_S,
                                       AutoscaleResult, FleetConfig, PolicySummary,
                                       ReplicaRecord, Timeline, bursty_trace, compare_policies,
                                       comparison_table, diurnal_trace, simulate_autoscaling,
                                       step_trace, trace_from_rate)

__all__ = [
    "CLEAN_POD_START_S", "COLD_START_S", "COLD_START_STEPS_S", "CONCURRENCY",
    "DEFAULT_SCALE_DOWN", "DEFAULT_SCALE_UP", "GPU_UTILIZATION", "KV_CACHE_USAGE", "RUNNING",
    "WAITING", "AutoscaleResult", "FleetConfig", "GPUMetric", "HPADecision",
    "HPAScalingPolicy", "HPAScalingRules", "HorizontalPodAutoscaler", "KPADecision",
    "KedaAutoscaler", "KnativePodAutoscaler", "Observation", "PodMetrics", "Policy",
    "PolicySummary", "ReplicaRecord", "ScaleEvent", "ThresholdPolicy", "ThresholdRule",
    "Timeline", "bursty_trace", "compare_policies", "comparison_table", "demo_metric",
    "diurnal_trace", "simulate_autoscaling", "step_trace", "threshold_demo", "trace_from_rate",
]
