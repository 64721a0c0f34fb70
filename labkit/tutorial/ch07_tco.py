"""The tutorial's cloud-versus-self-hosted comparison (its chapter 7), as written, to hold our
numbers against (:ref:`ch07-tutorial-wrong`).

Its ``compare_cloud_vs_selfhost`` prices eight GPUs two ways with constants typed into the code
and prints a recommendation. :func:`tutorial_compare_cloud_vs_selfhost` is that function,
formula for formula, returning its numbers instead of printing them; the docstring says what is
wrong, and :class:`labkit.cost.Scenario` does it right (:meth:`~labkit.cost.Scenario.costs`,
:meth:`~labkit.cost.Scenario.breakeven`, :meth:`~labkit.cost.Scenario.payback`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TutorialEstimate:
    """What the tutorial's ``compare_cloud_vs_selfhost`` computes (chapter 7, "What the
    tutorial gets wrong"), as numbers instead of prints."""

    num_gpus: int
    gpu_type: str
    months: int
    hourly_usd: float
    gpu_price_usd: float
    price_is_fallback: bool
    cloud_monthly_usd: float
    cloud_total_usd: float
    hardware_usd: float
    monthly_ops_usd: float
    selfhost_total_usd: float
    breakeven_months: float | None
    recommends: str


def tutorial_compare_cloud_vs_selfhost(num_gpus: int = 8, gpu_type: str = "H100-SXM",
                                       monthly_utilization: float = 0.7,
                                       months: int = 24) -> TutorialEstimate:
    """The tutorial's cost comparison (:ref:`ch07-tutorial-wrong`), formula for formula, its
    constants included.

    Kept only so that the chapter and the lab can compute what it gets wrong: the cloud bill
    scaled by utilization, a flat $150 of power per GPU, no depreciation, one price per GPU
    type with a silent fallback for unknown names, a 720-hour month, and a payback computed
    only in the branch where self-hosting already won. :class:`labkit.cost.Scenario` bills
    every hour, prices power from TDP, PUE and $/kWh, depreciates the capex, and says when
    there is no payback and why.
    """
    cloud_hourly = {"H100-SXM": 3.50, "A100-80GB": 1.80, "L40S": 0.90}
    selfhost_gpu_cost = {"H100-SXM": 30000, "A100-80GB": 15000, "L40S": 7000}
    server_cost_per_gpu, monthly_power_per_gpu = 3000, 150
    monthly_maintenance, datacenter_monthly = 500, 2000
    hourly = cloud_hourly.get(gpu_type, 2.0)
    gpu_price = selfhost_gpu_cost.get(gpu_type, 15000)
    cloud_monthly = hourly * num_gpus * 24 * 30 * monthly_utilization
    cloud_total = cloud_monthly * months
    hardware = (gpu_price + server_cost_per_gpu) * num_gpus
    monthly_ops = monthly_power_per_gpu * num_gpus + monthly_maintenance + datacenter_monthly
    selfhost_total = hardware + monthly_ops * months
    breakeven = None
    if selfhost_total < cloud_total:
        breakeven = hardware / (cloud_monthly - monthly_ops)
    return TutorialEstimate(
        num_gpus=num_gpus, gpu_type=gpu_type, months=months, hourly_usd=hourly,
        gpu_price_usd=gpu_price, price_is_fallback=gpu_type not in cloud_hourly,
        cloud_monthly_usd=cloud_monthly, cloud_total_usd=cloud_total, hardware_usd=hardware,
        monthly_ops_usd=monthly_ops, selfhost_total_usd=selfhost_total,
        breakeven_months=breakeven,
        recommends="self-hosted" if selfhost_total < cloud_total else "cloud")
