"""The tutorial's GPU decision tree, derived instead of typed (:ref:`ch01-decision-tree`).

The tutorial's ``select_gpu`` walks model sizes (7, 13, 34, 70 and 100B+ parameters) and three
budgets, and returns strings someone typed. Here every branch is computed: chapter 1's
:func:`~labkit.hardware.select_gpu` lists the ways a model fits (GPU, precision, tensor-parallel
size) for a context length and a number of concurrent sequences, and chapter 6's price table
gives each of them an hourly price. A budget is then a rule for picking among the priced
options:

- **lowest cost**: the cheapest hour that fits, consumer cards included (several GeForce cards
  over PCIe are often the cheapest way in, with no ECC, no NVLink and no data-center support);
- **data-center GPUs**: the cheapest hour on parts built for a data center;
- **fastest**: the highest decode bound (chapter 1's roofline), whatever it costs.

A price is the median on-demand offer of the table for that many GPUs
(:func:`~labkit.cost.prices.gpu_hourly_price`); an option whose GPU has no price there is left
out and kept apart (``unpriced`` of :class:`PricedChoices`), never priced by guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import ParameterError
from labkit.cost.prices import GPUPrice, gpu_hourly_price
from labkit.hardware import ModelSpec, Recommendation, get_gpu, get_model, select_gpu

#: The budgets of the tutorial's tree, as rules over priced options (in this order).
BUDGETS = ("lowest cost", "data-center GPUs", "fastest")


@dataclass(frozen=True)
class PricedOption:
    """One way to serve a model (chapter 1's :class:`~labkit.hardware.Recommendation`) and the
    price of its GPUs: ``price`` is per GPU-hour, for ``option.num_gpus`` of them."""

    option: Recommendation
    price: GPUPrice

    @property
    def usd_per_hour(self) -> float:
        """What all of its GPUs cost an hour (US dollars)."""
        return self.price.usd_per_gpu_hour * self.option.num_gpus

    @property
    def consumer(self) -> bool:
        """A GeForce card: no ECC memory, no NVLink beyond a bridge, no data-center license."""
        return get_gpu(self.option.gpu).consumer

    @property
    def usd_per_1m_tokens_at_bound(self) -> float:
        """Dollars per million output tokens if it decoded at its roofline bound every second
        it is paid for: a floor, which a real engine at a real load stays above."""
        return self.usd_per_hour / (self.option.decode_tok_s * 3600) * 1e6

    def label(self) -> str:
        o = self.option
        link = ", PCIe" if o.num_gpus > 1 and o.over_pcie else ""
        return f"{o.num_gpus} x {o.gpu} {o.weight_dtype}{link}"


@dataclass(frozen=True)
class PricedChoices:
    """The priced options of one model and what each budget picks among them."""

    model: str
    max_model_len: int
    concurrency: int
    options: tuple[PricedOption, ...]
    unpriced: tuple[Recommendation, ...]

    def pick(self, budget: str) -> PricedOption | None:
        """The option ``budget`` (one of :data:`BUDGETS`) picks; None when nothing qualifies."""
        if budget == "lowest cost":
            pool = self.options
        elif budget == "data-center GPUs":
            pool = tuple(o for o in self.options if not o.consumer)
        elif budget == "fastest":
            return max(self.options, key=lambda o: (o.option.decode_tok_s, -o.usd_per_hour),
                       default=None)
        else:
            raise ParameterError("budget", f"budget must be one of {BUDGETS}, got {budget!r}")
        return min(pool, key=lambda o: (o.usd_per_hour, -o.option.decode_tok_s), default=None)


def priced_choices(model: ModelSpec | str, max_model_len: int = 8192, concurrency: int = 16,
                   pricing: str = "on_demand") -> PricedChoices:
    """Every way ``model`` fits (:func:`~labkit.hardware.select_gpu`, up to 8 GPUs), each at
    the table's median ``pricing`` offer for that many GPUs, cheapest hour first
    (:ref:`ch01-decision-tree`). GPUs the table does not price are listed in ``unpriced``."""
    options = select_gpu(model, max_model_len=max_model_len, concurrency=concurrency)
    priced, unpriced = [], []
    for option in options:
        try:
            price = gpu_hourly_price(option.gpu, pricing=pricing, num_gpus=option.num_gpus)
        except ParameterError:
            unpriced.append(option)
            continue
        priced.append(PricedOption(option, price))
    priced.sort(key=lambda o: (o.usd_per_hour, -o.option.decode_tok_s))
    return PricedChoices(get_model(model).name, max_model_len, concurrency, tuple(priced),
                         tuple(unpriced))
