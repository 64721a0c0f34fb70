"""What GPUs and APIs cost, from dated, sourced price tables (:ref:`ch06-token-cost`).

Two tables live in ``labkit/data/``, one row per offer, each with the page it was read from
(``source``) and the day the price held (``as_of``, ``YYYY-MM-DD``, or ``YYYY-MM`` when the
page gives only a month):

- ``gpu_prices.csv``: dollars per GPU-hour for one GPU of the chapter 1 table (its exact
  name), from one provider, under one pricing model (:data:`PRICING_MODELS`). ``min_gpus``
  is the smallest number of GPUs the offer rents (8 for a whole 8-GPU instance).
- ``api_prices.csv``: dollars per million input, cached input and output tokens of a hosted
  model (cached input is blank where the provider has no discount for it). A card bills a
  :class:`TokenMix`, the token counts of OpenAI's ``usage``, where the cached prompt tokens are
  part of the prompt tokens.

Prices move weekly and differ by 5x between providers for the same chip, so nothing here is
a constant: every function takes the table as a parameter (``table=``), a row can be made by
hand (``GPUPrice(...)`` with your own quote), and :func:`gpu_price_range` shows the spread
rather than one number.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from labkit.checks import ParameterError, in_range, positive_int
from labkit.data import read_csv
from labkit.hardware import get_gpu, list_gpus

#: How a GPU-hour is bought. ``on_demand``: no commitment, billed while the instance runs;
#: ``committed_1y`` / ``committed_3y``: a lower rate for paying every hour of a 1- or 3-year
#: term; ``spot``: spare capacity at a discount, which the provider can take back at short
#: notice; ``capacity_block``: a reservation of a fixed window (days to weeks), paid up front.
PRICING_MODELS = ("on_demand", "committed_1y", "committed_3y", "spot", "capacity_block")

#: Hours in an average month: 365 days x 24 h / 12. (A 30-day month, 720 h, is 1.4 % short.)
HOURS_PER_MONTH = 365 * 24 / 12

_AS_OF = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


def _check_source(source: str, as_of: str) -> None:
    if not source.strip():
        raise ParameterError("source", "source must say where the price comes from "
                                       "(a URL, or 'quote from ...')")
    if not _AS_OF.match(as_of):
        raise ParameterError("as_of", f"as_of must be a date, YYYY-MM-DD or YYYY-MM, "
                                      f"got {as_of!r}")


@dataclass(frozen=True)
class GPUPrice:
    """One offer for one GPU (:ref:`ch06-token-cost`): ``usd_per_gpu_hour`` for each GPU rented.

    ``gpu`` is a name of the chapter 1 table (``labkit/data/gpus.csv``); an unknown name is
    refused, so a price always meets the datasheet it belongs to.
    """

    gpu: str
    provider: str
    pricing: str
    usd_per_gpu_hour: float
    source: str
    as_of: str
    min_gpus: int = 1
    product: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu", get_gpu(self.gpu).name)
        if self.pricing not in PRICING_MODELS:
            raise ParameterError("pricing", f"pricing must be one of {PRICING_MODELS}, "
                                            f"got {self.pricing!r}")
        in_range("usd_per_gpu_hour", self.usd_per_gpu_hour, 0, low_open=True)
        positive_int("min_gpus", self.min_gpus)
        _check_source(self.source, self.as_of)

    def citation(self) -> str:
        """Where the number comes from, in one line: provider, product, price, date, page."""
        product = f", {self.product}" if self.product else ""
        return (f"{self.provider}{product} ({self.pricing}): ${self.usd_per_gpu_hour:.2f} per "
                f"GPU-hour as of {self.as_of}, {self.source}")


@dataclass(frozen=True)
class TokenMix:
    """Tokens an API bills, counted as OpenAI's ``usage`` counts them (:ref:`ch06-input-output`,
    :ref:`ch07-three-ways`): one response's, or a month of traffic's.

    ``input_tokens`` are all the prompt tokens (``usage.prompt_tokens``), *including* the
    ``cached_input_tokens`` the provider served from its prompt cache
    (``usage.prompt_tokens_details.cached_tokens``); ``output_tokens`` are the generated ones
    (``usage.completion_tokens``). A month's mix is the sum of its responses' usage.
    """

    input_tokens: float
    output_tokens: float
    cached_input_tokens: float = 0.0

    def __post_init__(self) -> None:
        in_range("input_tokens", self.input_tokens, 0)
        in_range("output_tokens", self.output_tokens, 0)
        in_range("cached_input_tokens", self.cached_input_tokens, 0, self.input_tokens)

    @property
    def total_tokens(self) -> float:
        """Prompt and generated tokens (the cached ones are among the prompt tokens)."""
        return self.input_tokens + self.output_tokens

    def scaled_to(self, total_tokens: float) -> TokenMix:
        """The same mix at another volume (``total_tokens``, input and output together)."""
        in_range("total_tokens", total_tokens, 0, low_open=True)
        factor = total_tokens / self.total_tokens
        return TokenMix(self.input_tokens * factor, self.output_tokens * factor,
                        self.cached_input_tokens * factor)


@dataclass(frozen=True)
class APIPrice:
    """A hosted model's price card, dollars per million tokens (:ref:`ch06-input-output`,
    :ref:`ch07-three-ways`). ``usd_per_1m_cached_input`` is None where the provider gives no
    discount for cached prompt tokens: they then pay the input price."""

    provider: str
    model: str
    usd_per_1m_input: float
    usd_per_1m_cached_input: float | None
    usd_per_1m_output: float
    source: str
    as_of: str
    notes: str = ""

    def __post_init__(self) -> None:
        in_range("usd_per_1m_input", self.usd_per_1m_input, 0)
        in_range("usd_per_1m_output", self.usd_per_1m_output, 0)
        if self.usd_per_1m_cached_input is not None:
            in_range("usd_per_1m_cached_input", self.usd_per_1m_cached_input, 0)
        _check_source(self.source, self.as_of)

    def cost_usd(self, tokens: TokenMix) -> float:
        """Dollars for ``tokens`` (:ref:`ch07-three-ways`): the prompt tokens not served from
        the cache at the input price, the cached ones at the cached price (the input price if
        the card has none), the output tokens at the output price.

        The cached tokens are among the prompt tokens, as OpenAI's ``usage`` reports them;
        billing them on top of ``input_tokens`` would count them twice. Cache writes, which
        some providers charge extra for, are not modelled.
        """
        cached_price = (self.usd_per_1m_input if self.usd_per_1m_cached_input is None
                        else self.usd_per_1m_cached_input)
        return ((tokens.input_tokens - tokens.cached_input_tokens) * self.usd_per_1m_input
                + tokens.cached_input_tokens * cached_price
                + tokens.output_tokens * self.usd_per_1m_output) / 1e6

    def citation(self) -> str:
        """Where the card comes from, in one line: model, prices, date, page."""
        return (f"{self.provider} {self.model}: ${self.usd_per_1m_input:g} in / "
                f"${self.usd_per_1m_output:g} out per 1M tokens as of {self.as_of}, "
                f"{self.source}")


def _optional_float(cell: str) -> float | None:
    return float(cell) if cell.strip() else None


@lru_cache(maxsize=1)
def load_gpu_prices() -> tuple[GPUPrice, ...]:
    """The GPU price table, ``labkit/data/gpu_prices.csv`` (:ref:`ch06-token-cost`)."""
    return tuple(GPUPrice(gpu=r["gpu"], provider=r["provider"], pricing=r["pricing"],
                          usd_per_gpu_hour=float(r["usd_per_gpu_hour"]),
                          min_gpus=int(r["min_gpus"]), product=r["product"],
                          source=r["source"], as_of=r["as_of"], notes=r["notes"])
                 for r in read_csv("gpu_prices.csv"))


@lru_cache(maxsize=1)
def load_api_prices() -> tuple[APIPrice, ...]:
    """The API price cards, ``labkit/data/api_prices.csv`` (:ref:`ch06-input-output`)."""
    return tuple(APIPrice(provider=r["provider"], model=r["model"],
                          usd_per_1m_input=float(r["usd_per_1m_input"]),
                          usd_per_1m_cached_input=_optional_float(r["usd_per_1m_cached_input"]),
                          usd_per_1m_output=float(r["usd_per_1m_output"]),
                          source=r["source"], as_of=r["as_of"], notes=r["notes"])
                 for r in read_csv("api_prices.csv"))


def _same(a: str, b: str) -> bool:
    return a.casefold() == b.casefold()


def gpu_prices(gpu: str | None = None, *, provider: str | None = None,
               pricing: str | None = None, num_gpus: int | None = None,
               table: Sequence[GPUPrice] | None = None) -> list[GPUPrice]:
    """The rows that match, cheapest first (:ref:`ch06-token-cost`). ``num_gpus`` keeps the offers
    one can take for that many GPUs (``min_gpus <= num_gpus``); ``None`` filters nothing."""
    rows = load_gpu_prices() if table is None else table
    name = get_gpu(gpu).name if gpu is not None else None
    if pricing is not None and pricing not in PRICING_MODELS:
        raise ParameterError("pricing", f"pricing must be one of {PRICING_MODELS}, "
                                        f"got {pricing!r}")
    if num_gpus is not None:
        positive_int("num_gpus", num_gpus)
    found = [r for r in rows
             if (name is None or r.gpu == name)
             and (provider is None or _same(r.provider, provider))
             and (pricing is None or r.pricing == pricing)
             and (num_gpus is None or r.min_gpus <= num_gpus)]
    return sorted(found, key=lambda r: (r.usd_per_gpu_hour, r.provider))


@dataclass(frozen=True)
class PriceRange:
    """The spread of one GPU's price under one pricing model (:ref:`ch06-token-cost`): every
    matching row, cheapest first."""

    gpu: str
    pricing: str
    rows: tuple[GPUPrice, ...]

    @property
    def low(self) -> GPUPrice:
        return self.rows[0]

    @property
    def high(self) -> GPUPrice:
        return self.rows[-1]

    @property
    def median(self) -> GPUPrice:
        """The middle row; of an even number, the cheaper of the two middle rows, so that the
        typical price is always a real, dated offer rather than an average of two."""
        return self.rows[(len(self.rows) - 1) // 2]

    @property
    def median_usd_per_gpu_hour(self) -> float:
        """The statistical median of the prices (the mean of the two middle ones if even)."""
        return statistics.median(r.usd_per_gpu_hour for r in self.rows)

    @property
    def spread(self) -> float:
        """Dearest over cheapest."""
        return self.high.usd_per_gpu_hour / self.low.usd_per_gpu_hour

    def __str__(self) -> str:
        dates = sorted({r.as_of for r in self.rows})
        return (f"{self.gpu} {self.pricing}: ${self.low.usd_per_gpu_hour:.2f} "
                f"({self.low.provider}) to ${self.high.usd_per_gpu_hour:.2f} "
                f"({self.high.provider}) per GPU-hour, {len(self.rows)} offers dated "
                f"{dates[0]} to {dates[-1]}")


def gpu_price_range(gpu: str, pricing: str = "on_demand", *, num_gpus: int | None = None,
                    table: Sequence[GPUPrice] | None = None) -> PriceRange:
    """Every offer for ``gpu`` under ``pricing`` (:ref:`ch06-token-cost`); raises if there
    is none."""
    rows = gpu_prices(gpu, pricing=pricing, num_gpus=num_gpus, table=table)
    if not rows:
        raise ParameterError("gpu", f"no {pricing} price for {get_gpu(gpu).name} in the table"
                                    + (f" for {num_gpus} GPUs" if num_gpus else ""))
    return PriceRange(rows[0].gpu, pricing, tuple(rows))


def gpu_hourly_price(gpu: str, provider: str | None = None, pricing: str = "on_demand", *,
                     num_gpus: int = 1, table: Sequence[GPUPrice] | None = None) -> GPUPrice:
    """One row to price ``num_gpus`` of ``gpu`` with (:ref:`ch06-token-cost`).

    With a ``provider``, that provider's cheapest offer one can take for ``num_gpus`` GPUs
    (an 8-GPU instance is often cheaper per GPU, but only for 8 or more); without one, the
    median offer of the table (:attr:`PriceRange.median`). Raises ``ParameterError`` when
    nothing matches, naming the providers that do sell it.
    """
    if provider is None:
        return gpu_price_range(gpu, pricing, num_gpus=num_gpus, table=table).median
    rows = gpu_prices(gpu, provider=provider, pricing=pricing, num_gpus=num_gpus, table=table)
    if not rows:
        known = sorted({r.provider for r in gpu_prices(gpu, pricing=pricing, table=table)})
        raise ParameterError("provider", f"no {pricing} price for {get_gpu(gpu).name} from "
                                         f"{provider!r} for {num_gpus} GPU(s); providers in "
                                         f"the table: {', '.join(known) or 'none'}")
    return rows[0]


def api_price(provider: str, model: str,
              table: Sequence[APIPrice] | None = None) -> APIPrice:
    """The price card of ``model`` at ``provider`` (case ignored) (:ref:`ch06-input-output`)."""
    rows = load_api_prices() if table is None else table
    for row in rows:
        if _same(row.provider, provider) and _same(row.model, model):
            return row
    known = ", ".join(f"{r.provider}/{r.model}" for r in rows)
    raise ParameterError("model", f"no API price for {provider}/{model}; known: {known}")


def price_range_table(pricing: str = "on_demand",
                      table: Sequence[GPUPrice] | None = None) -> str:
    """A Markdown table of every GPU's price range under ``pricing``, with dates
    (:ref:`ch06-token-cost`), generated from the data file."""
    rows = gpu_prices(pricing=pricing, table=table)
    lines = ["| GPU | cheapest | median | dearest | offers | dated |",
             "|---|---|---|---|---:|---|"]
    for name in dict.fromkeys(r.gpu for r in sorted(rows, key=lambda r: _gpu_order(r.gpu))):
        spread = gpu_price_range(name, pricing, table=rows)
        dates = sorted({r.as_of for r in spread.rows})
        lines.append(
            f"| {name} | ${spread.low.usd_per_gpu_hour:.2f} ({spread.low.provider}) "
            f"| ${spread.median_usd_per_gpu_hour:.2f} "
            f"| ${spread.high.usd_per_gpu_hour:.2f} ({spread.high.provider}) "
            f"| {len(spread.rows)} | {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1
                                                   else "") + " |")
    return "\n".join(lines)


def _gpu_order(name: str) -> float:
    """Position of a GPU in the chapter 1 table, so price tables follow its order."""
    names = [g.name for g in list_gpus()]
    return names.index(name) if name in names else math.inf
