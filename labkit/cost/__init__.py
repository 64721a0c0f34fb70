"""The cost of inference (chapters 6 and 7): every number from a price table or a measurement.

- :mod:`~labkit.cost.prices`: sourced, dated $/GPU-hour and API price cards, as parameters
  (:ref:`ch06-token-cost`);
- :mod:`~labkit.cost.choose`: chapter 1's ways to fit a model, priced, and what each budget
  picks (the tutorial's decision tree, :ref:`ch01-decision-tree`), imported on its own;
- :mod:`~labkit.cost.capacity`: the most traffic a deployment serves inside a latency SLO,
  searched with chapter 3's simulator (:ref:`ch06-throughput-slo`);
- :mod:`~labkit.cost.tokens`: $ per 1M input and output tokens from that throughput
  (:ref:`ch06-input-output`);
- :mod:`~labkit.cost.compare`: deployments over GPU x precision x TP, fleets fixed or
  autoscaled (chapter 5; :ref:`ch06-month-of-traffic`, :ref:`ch06-comparing`);
- :mod:`~labkit.cost.tco`: cloud, an API or your own servers, and the guarded breakeven
  (:ref:`ch07-three-ways`);
  :mod:`~labkit.cost.sensitivity` (plots and a widget) is imported on its own;
- :mod:`~labkit.cost.tradeoffs`: what the bill leaves out, one sourced fact per factor and
  option (:ref:`ch07-beyond-cost`), imported on its own.

The tutorial's own cost code, kept to be judged, is :mod:`labkit.tutorial.ch06_cost` and
:mod:`labkit.tutorial.ch07_tco`.
"""

from labkit.cost.capacity import LatencySLO, SLOCapacity, max_rate_at_slo, saturation_request_rate
from labkit.cost.compare import (AutoscaledCost, DeploymentOption, FleetCost, TrafficProfile,
                                 autoscaled_fleet_cost, compare_deployments, comparison_table,
                                 fixed_fleet_cost, monthly_cost_usd, replicas_needed)
from labkit.cost.prices import (HOURS_PER_MONTH, APIPrice, GPUPrice, PriceRange, TokenMix,
                                api_price, gpu_hourly_price, gpu_price_range, gpu_prices,
                                price_range_table)
from labkit.cost.tco import Breakeven, Payback, Scenario
from labkit.cost.tokens import Throughput, TokenCost, throughput_from_benchmark, token_cost

__all__ = [
    "HOURS_PER_MONTH", "APIPrice", "AutoscaledCost", "Breakeven", "DeploymentOption",
    "FleetCost", "GPUPrice", "LatencySLO", "Payback", "PriceRange", "SLOCapacity", "Scenario",
    "Throughput", "TokenCost", "TokenMix", "TrafficProfile", "api_price",
    "autoscaled_fleet_cost", "compare_deployments", "comparison_table", "fixed_fleet_cost",
    "gpu_hourly_price", "gpu_price_range", "gpu_prices", "max_rate_at_slo", "monthly_cost_usd",
    "price_range_table", "replicas_needed", "saturation_request_rate",
    "throughput_from_benchmark", "token_cost",
]
