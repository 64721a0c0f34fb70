"""Cloud, an API, or your own GPUs: total cost of ownership and the breakeven
(:ref:`ch07-owning`, :ref:`ch07-three-ways`).

The question of chapter 7 is not "is a GPU cheaper to buy than to rent" but "what does it
cost to serve *this* traffic" three ways:

- an **API** bills tokens: input, cached input and output, each at its price per 1M tokens
  (chapter 6's :class:`~labkit.cost.prices.APIPrice` billing a
  :class:`~labkit.cost.prices.TokenMix`, OpenAI's ``usage`` convention);
- **cloud GPUs** bill GPU-hours for as long as the instances run, busy or idle;
- **self-hosting** buys servers (capex, depreciated over their useful life) and pays every
  month for power (GPU TDP x server overhead x PUE x $/kWh x hours), colocation (per kW of
  IT capacity), and the people who run it.

Serving more tokens needs more GPUs, and servers come whole, so the self-hosted cost is a
step function of volume while the API's is a straight line through zero. Where they cross is
the breakeven; it may not exist (a fully used server costs more than the API charges for the
tokens it serves), and there may be several crossings (each new server lifts the cost above
the API line again for a while). :meth:`~labkit.cost.Scenario.breakeven` finds them on the step
function and says "never", with the reason, instead of dividing by a zero or negative margin.

Every price and rate is a parameter. ``labkit/data/gpu_capex.csv`` and
``labkit/data/tco_inputs.csv`` hold sourced, dated values to start from
(:func:`capex_rows`, :func:`input_rows`, :func:`input_range`); nothing here has a price
built in. The tutorial's hard-coded comparison is :mod:`labkit.tutorial.ch07_tco`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from labkit.checks import ParameterError, in_range, positive_int
from labkit.cost.compare import monthly_cost_usd, replicas_needed
from labkit.cost.prices import HOURS_PER_MONTH, APIPrice, GPUPrice, TokenMix  # 730 h a month
from labkit.cost.tokens import Throughput
from labkit.data import read_csv
from labkit.hardware import get_gpu
from labkit.units import cdiv

SECONDS_PER_MONTH = HOURS_PER_MONTH * 3600

#: :meth:`Scenario.breakeven` lists the first crossings only (it counts them all).
_MAX_CROSSINGS_LISTED = 10


# --- the sourced tables --------------------------------------------------------------------


@dataclass(frozen=True)
class CapexRow:
    """One purchase price from ``gpu_capex.csv``: a card (``gpus`` = 1) or a whole server.

    ``gpu`` is the name in chapter 1's GPU table; prices are US dollars for the whole item.
    """

    item: str
    gpu: str
    gpus: int
    condition: str
    price_low_usd: float
    price_high_usd: float
    basis: str
    source: str
    as_of: str
    notes: str

    def provenance(self) -> str:
        return f"{self.item}: {self.basis} ({self.source}, {self.as_of})"


@dataclass(frozen=True)
class InputRow:
    """One sourced value of a TCO input from ``tco_inputs.csv`` (electricity, PUE, ...)."""

    input: str
    value: float
    unit: str
    what: str
    source: str
    as_of: str
    notes: str

    def provenance(self) -> str:
        return f"{self.what} ({self.source}, {self.as_of})"


@lru_cache(maxsize=1)
def capex_rows() -> tuple[CapexRow, ...]:
    """Every row of ``labkit/data/gpu_capex.csv`` (:ref:`ch07-owning`), in table order."""
    return tuple(CapexRow(item=r["item"], gpu=r["gpu"], gpus=int(r["gpus"]),
                          condition=r["condition"], price_low_usd=float(r["price_low_usd"]),
                          price_high_usd=float(r["price_high_usd"]), basis=r["basis"],
                          source=r["source"], as_of=r["as_of"], notes=r["notes"])
                 for r in read_csv("gpu_capex.csv"))


@lru_cache(maxsize=1)
def input_rows() -> tuple[InputRow, ...]:
    """Every row of ``labkit/data/tco_inputs.csv`` (:ref:`ch07-owning`), in table order."""
    return tuple(InputRow(input=r["input"], value=float(r["value"]), unit=r["unit"],
                          what=r["what"], source=r["source"], as_of=r["as_of"],
                          notes=r["notes"])
                 for r in read_csv("tco_inputs.csv"))


def input_range(name: str) -> tuple[InputRow, InputRow]:
    """The lowest and highest sourced values of one input, e.g. ``"pue"`` (chapter 7).

    The sensitivity analysis swings each input between these two rows.
    """
    rows = [r for r in input_rows() if r.input == name]
    if not rows:
        known = sorted({r.input for r in input_rows()})
        raise ParameterError("name", f"name must be one of {known}, got {name!r}")
    return min(rows, key=lambda r: r.value), max(rows, key=lambda r: r.value)


def input_row(name: str, containing: str) -> InputRow:
    """The row of input ``name`` whose description contains ``containing`` (case ignored)."""
    for row in input_rows():
        if row.input == name and containing.lower() in row.what.lower():
            return row
    raise ParameterError("containing", f"containing must match the description of a {name} "
                                       f"row, got {containing!r}")


def capex_for(gpu: str, gpus: int | None = None, condition: str = "new") -> list[CapexRow]:
    """Purchase-price rows for ``gpu`` (a chapter 1 name), optionally only items of ``gpus``
    GPUs (1: the card alone; 8: a whole server)."""
    name = get_gpu(gpu).name
    rows = [r for r in capex_rows() if r.gpu == name and r.condition == condition
            and (gpus is None or r.gpus == gpus)]
    if not rows:
        raise ParameterError("gpu", f"no {condition} purchase price for {name!r}"
                                    + (f" in items of {gpus} GPUs" if gpus else ""))
    return rows


# --- self-hosted and cloud costs ------------------------------------------------------------


@dataclass(frozen=True)
class SelfHostedMonth:
    """One month of owning ``servers`` servers, by cost line (US dollars, :ref:`ch07-owning`)."""

    servers: int
    gpus: int
    capex_usd: float
    it_power_kw: float
    energy_kwh: float
    depreciation_usd: float
    power_usd: float
    colocation_usd: float
    staff_usd: float

    @property
    def opex_usd(self) -> float:
        """What leaves the bank each month once the servers are paid for."""
        return self.power_usd + self.colocation_usd + self.staff_usd

    @property
    def total_usd(self) -> float:
        return self.depreciation_usd + self.opex_usd


@dataclass(frozen=True)
class SelfHosted:
    """The cost inputs of a self-hosted deployment (:ref:`ch07-owning`). All prices are parameters.

    - ``capex_per_server_usd``: price of one server with ``gpus_per_server`` GPUs, depreciated
      straight-line over ``depreciation_years`` down to ``salvage_fraction`` of its price;
    - power: the GPUs' TDP (chapter 1's table, or ``tdp_w``) x ``gpu_power_fraction`` (their
      average draw; 1.0 is the worst case) x ``server_power_ratio`` (CPUs, memory, fans, NICs:
      server wall power over GPU TDP) x ``pue`` (cooling and power distribution) x
      ``electricity_usd_kwh`` x ``HOURS_PER_MONTH``;
    - ``colocation_usd_kw_month``: rent per kW of IT capacity (the servers at full power);
      0 when you own the building, whose cost is then yours to add;
    - ``staff_fte`` people at ``staff_usd_year`` each: fixed for the deployment, whatever
      its size in the range you study.
    """

    gpu: str
    capex_per_server_usd: float
    depreciation_years: float
    pue: float
    electricity_usd_kwh: float
    server_power_ratio: float
    colocation_usd_kw_month: float
    staff_usd_year: float
    staff_fte: float
    gpus_per_server: int = 8
    salvage_fraction: float = 0.0
    gpu_power_fraction: float = 1.0
    tdp_w: float | None = None

    def __post_init__(self) -> None:
        get_gpu(self.gpu)
        in_range("capex_per_server_usd", self.capex_per_server_usd, 0)
        in_range("depreciation_years", self.depreciation_years, 0, low_open=True)
        in_range("pue", self.pue, 1)
        in_range("electricity_usd_kwh", self.electricity_usd_kwh, 0)
        in_range("server_power_ratio", self.server_power_ratio, 1)
        in_range("colocation_usd_kw_month", self.colocation_usd_kw_month, 0)
        in_range("staff_usd_year", self.staff_usd_year, 0)
        in_range("staff_fte", self.staff_fte, 0)
        positive_int("gpus_per_server", self.gpus_per_server)
        in_range("salvage_fraction", self.salvage_fraction, 0, 1, high_open=True)
        in_range("gpu_power_fraction", self.gpu_power_fraction, 0, 1, low_open=True)
        if self.tdp_w is not None:
            in_range("tdp_w", self.tdp_w, 0, low_open=True)

    @property
    def gpu_tdp_w(self) -> float:
        return self.tdp_w if self.tdp_w is not None else get_gpu(self.gpu).tdp_w

    def month(self, servers: int) -> SelfHostedMonth:
        """The cost lines of one month with ``servers`` servers running (:ref:`ch07-owning`)."""
        positive_int("servers", servers, at_least=0)
        gpus = servers * self.gpus_per_server
        capex = servers * self.capex_per_server_usd
        depreciation = capex * (1 - self.salvage_fraction) / (self.depreciation_years * 12)
        # Colocation rents capacity: the servers at full power. The meter sees the average.
        it_kw = gpus * self.gpu_tdp_w * self.server_power_ratio / 1000
        energy_kwh = it_kw * self.gpu_power_fraction * self.pue * HOURS_PER_MONTH
        return SelfHostedMonth(
            servers=servers, gpus=gpus, capex_usd=capex, it_power_kw=it_kw,
            energy_kwh=energy_kwh, depreciation_usd=depreciation,
            power_usd=energy_kwh * self.electricity_usd_kwh,
            colocation_usd=it_kw * self.colocation_usd_kw_month,
            staff_usd=self.staff_fte * self.staff_usd_year / 12)

    @property
    def fixed_usd_month(self) -> float:
        """The part of the monthly cost that does not grow with servers (the staff)."""
        return self.month(0).total_usd

    @property
    def per_server_usd_month(self) -> float:
        """What each additional server adds to a month: depreciation, power, colocation."""
        return self.month(1).total_usd - self.month(0).total_usd


@dataclass(frozen=True)
class Cloud:
    """Rented GPUs (:ref:`ch07-three-ways`): ``usd_gpu_hour`` for every hour an instance runs.

    ``billed_fraction`` is the share of the month the instances are up. Reserved capacity, or
    on-demand instances that are never shut down, bill 100 % of the hours however little
    they are used: utilization lowers the bill only if replicas are actually stopped (chapter
    5's autoscaler), and then ``billed_fraction`` is the replica-hours actually run.
    """

    usd_gpu_hour: float
    gpus_per_instance: int = 1
    billed_fraction: float = 1.0
    provenance: str = ""

    def __post_init__(self) -> None:
        in_range("usd_gpu_hour", self.usd_gpu_hour, 0)
        positive_int("gpus_per_instance", self.gpus_per_instance)
        in_range("billed_fraction", self.billed_fraction, 0, 1, low_open=True)

    @classmethod
    def from_price(cls, price: GPUPrice, billed_fraction: float = 1.0) -> Cloud:
        """Cloud GPUs at a row of chapter 6's price table, rented in instances of its
        ``min_gpus`` GPUs."""
        return cls(price.usd_per_gpu_hour, price.min_gpus, billed_fraction, price.citation())

    def instances_for(self, gpus: int) -> int:
        """Whole instances that hold ``gpus`` GPUs."""
        return cdiv(positive_int("gpus", gpus, at_least=0), self.gpus_per_instance)

    def usd_for_hours(self, gpus: int, hours: float) -> float:
        """The bill for ``hours`` hours of instances holding ``gpus`` GPUs: renting while
        owned servers are on order, for instance (:ref:`ch07-beyond-cost`)."""
        return self.monthly_usd(gpus) * in_range("hours", hours, 0) / HOURS_PER_MONTH

    def monthly_usd(self, gpus: int) -> float:
        """The month's bill for enough instances to hold ``gpus`` GPUs, up
        ``billed_fraction`` of its hours (chapter 6's
        :func:`~labkit.cost.compare.monthly_cost_usd`)."""
        return (monthly_cost_usd(self.instances_for(gpus), self.gpus_per_instance,
                                 self.usd_gpu_hour) * self.billed_fraction)


# --- the scenario: one traffic, three ways to serve it -------------------------------------


@dataclass(frozen=True)
class MonthlyCosts:
    """The three monthly bills for one traffic level (US dollars, :ref:`ch07-three-ways`)."""

    traffic: TokenMix
    gpus_needed: int
    servers: int
    api_usd: float
    self_hosted: SelfHostedMonth
    cloud_usd: float | None

    @property
    def self_hosted_usd(self) -> float:
        return self.self_hosted.total_usd

    @property
    def self_minus_api_usd(self) -> float:
        """Positive: self-hosting costs more than the API this month."""
        return self.self_hosted_usd - self.api_usd


@dataclass(frozen=True)
class Crossing:
    """A volume where the cheaper option changes (:ref:`ch07-three-ways`): ``cheaper`` is the option
    that wins just above ``tokens_month`` (``"self-hosted"`` or ``"api"``), ``servers`` the servers
    the self-hosted side runs there."""

    tokens_month: float
    cheaper: str
    servers: int


@dataclass(frozen=True)
class Breakeven:
    """Where self-hosting becomes cheaper than the API for the same traffic
    (:ref:`ch07-three-ways`).

    ``never`` is True when no volume makes self-hosting strictly cheaper, and ``reason`` says
    why. Otherwise ``first_tokens_month`` is the smallest monthly volume (all tokens of the
    mix) above which self-hosting is cheaper, and ``stable_tokens_month`` the volume above
    which it stays cheaper; between the two the API wins again just after each new server is
    bought. ``crossings`` lists the first of them in volume order (``num_crossings`` in all).
    """

    never: bool
    reason: str
    api_usd_per_token: float
    server_capacity_tokens_month: float
    fixed_usd_month: float
    per_server_usd_month: float
    margin_usd_per_server_month: float
    first_tokens_month: float | None = None
    stable_tokens_month: float | None = None
    servers_at_first: int | None = None
    crossings: tuple[Crossing, ...] = ()
    num_crossings: int = 0

    def __str__(self) -> str:
        if self.never:
            return f"never: {self.reason}"
        text = (f"self-hosting is cheaper above {self.first_tokens_month:,.4g} tokens/month "
                f"({self.servers_at_first} server(s))")
        if self.num_crossings > 1:
            text += (f"; the API wins again after each new server until "
                     f"{self.stable_tokens_month:,.4g} tokens/month "
                     f"({self.num_crossings} crossings)")
        return text


@dataclass(frozen=True)
class Payback:
    """Months until buying the servers pays for itself against an alternative
    (:ref:`ch07-three-ways`).

    ``months`` is ``capex_usd / saving_usd_month``, where the saving is the alternative's
    monthly bill minus the self-hosted *running* cost (power, colocation, staff: the servers
    are already paid for). ``never`` when the saving is zero or negative, with the reason.
    ``within_life`` says whether it pays back before the servers are written off. Salvage
    value is left out, as simple payback does.
    """

    never: bool
    reason: str
    capex_usd: float
    saving_usd_month: float
    months: float | None
    within_life: bool

    def __str__(self) -> str:
        if self.never:
            return f"never: {self.reason}"
        life = "within" if self.within_life else "beyond"
        return f"{self.months:.1f} months ({life} the servers' useful life)"


@dataclass(frozen=True)
class Scenario:
    """One traffic, three ways to serve it (:ref:`ch07-three-ways`).

    ``capacity`` (chapter 6's :class:`~labkit.cost.tokens.Throughput`, simulated or measured
    on requests of the traffic's mix) sizes the fleet by its output tokens per second, in
    replicas of ``capacity.num_gpus`` GPUs each; a replica stays inside one server.
    ``peak_to_average`` (>= 1) is how much more than the monthly average the fleet must serve
    at peak: a self-hosted fleet is bought for the peak. ``min_servers`` is the smallest
    deployment you would run. ``cloud`` (optional) rents the same GPUs, sized the same way.
    """

    traffic: TokenMix
    api: APIPrice
    capacity: Throughput
    hardware: SelfHosted
    cloud: Cloud | None = None
    peak_to_average: float = 1.0
    min_servers: int = 1

    def __post_init__(self) -> None:
        in_range("peak_to_average", self.peak_to_average, 1)
        positive_int("min_servers", self.min_servers)
        if not self.traffic.output_tokens > 0:
            raise ParameterError("traffic", "traffic.output_tokens must be > 0: the fleet is "
                                            "sized in output tokens per second")
        if self.capacity.num_gpus > self.hardware.gpus_per_server:
            raise ParameterError("capacity", f"capacity.num_gpus must be <= "
                                             f"hardware.gpus_per_server "
                                             f"({self.hardware.gpus_per_server}): a replica "
                                             f"stays inside one server, got "
                                             f"{self.capacity.num_gpus}")

    def with_value(self, path: str, value: object) -> Scenario:
        """A copy with one input changed: ``"hardware.pue"``, ``"api.usd_per_1m_output"``,
        ``"peak_to_average"``... (chapter 7's sensitivity analysis uses this)."""
        head, _, rest = path.partition(".")
        if not any(f.name == head for f in dataclasses.fields(self)):
            raise ParameterError("path", f"path must start with a Scenario field, got {path!r}")
        if not rest:
            return dataclasses.replace(self, **{head: value})
        inner = getattr(self, head)
        if inner is None or not any(f.name == rest for f in dataclasses.fields(inner)):
            raise ParameterError("path", f"path must name a field of {head}, got {path!r}")
        return dataclasses.replace(self, **{head: dataclasses.replace(inner, **{rest: value})})

    def value(self, path: str) -> object:
        """The value of one input, by the same dotted path as :meth:`with_value`."""
        obj: object = self
        for part in path.split("."):
            if obj is None or not hasattr(obj, part):
                raise ParameterError("path", f"path must name an input of the scenario, "
                                             f"got {path!r}")
            obj = getattr(obj, part)
        return obj

    # sizing

    def _mix(self, total_tokens: float | None) -> TokenMix:
        return self.traffic if total_tokens is None else self.traffic.scaled_to(total_tokens)

    def replicas_needed(self, total_tokens: float | None = None) -> int:
        """Replicas that serve the traffic at its peak: peak output tok/s over a replica's,
        rounded up (chapter 6's :func:`~labkit.cost.compare.replicas_needed`)."""
        mix = self._mix(total_tokens)
        peak_tok_s = mix.output_tokens / SECONDS_PER_MONTH * self.peak_to_average
        return replicas_needed(peak_tok_s, self.capacity.output_tok_s)

    def gpus_needed(self, total_tokens: float | None = None) -> int:
        """GPUs of the replicas that serve the traffic at its peak."""
        return self.replicas_needed(total_tokens) * self.capacity.num_gpus

    @property
    def replicas_per_server(self) -> int:
        return self.hardware.gpus_per_server // self.capacity.num_gpus

    def servers_needed(self, total_tokens: float | None = None) -> int:
        """Whole servers that hold the replicas, at least ``min_servers``."""
        return max(self.min_servers,
                   cdiv(self.replicas_needed(total_tokens), self.replicas_per_server))

    @property
    def server_capacity_tokens_month(self) -> float:
        """Monthly volume (all tokens of the mix) one full server serves at this peak factor:
        the width of one step of the self-hosted cost."""
        output = (self.replicas_per_server * self.capacity.output_tok_s * SECONDS_PER_MONTH
                  / self.peak_to_average)
        return output * self.traffic.total_tokens / self.traffic.output_tokens

    # costs

    def costs(self, total_tokens: float | None = None) -> MonthlyCosts:
        """The three monthly bills at this scenario's traffic, or at ``total_tokens``."""
        mix = self._mix(total_tokens)
        gpus = self.gpus_needed(total_tokens)
        servers = self.servers_needed(total_tokens)
        return MonthlyCosts(traffic=mix, gpus_needed=gpus, servers=servers,
                            api_usd=self.api.cost_usd(mix),
                            self_hosted=self.hardware.month(servers),
                            cloud_usd=None if self.cloud is None else self.cloud.monthly_usd(gpus))

    def breakeven(self) -> Breakeven:
        """The monthly volume where self-hosting becomes cheaper than the API
        (:ref:`ch07-three-ways`).

        On the step function: with ``k`` servers the self-hosted cost is ``F + k c`` (fixed
        staff ``F``, per-server ``c``) for every volume from ``(k-1) Q`` to ``k Q`` (``Q``, a
        server's capacity), against ``a V`` for the API (``a``, its blended price per token).
        Self-hosting wins on step ``k`` above ``V = (F + k c) / a``, if that is below ``k Q``:
        ``k > F / m`` with the margin ``m = a Q - c``, what a full server saves each month
        before the fixed cost. With ``m <= 0`` that never happens, however large the volume:
        the answer is "never", not a division by zero.
        """
        a = self.api.cost_usd(self.traffic) / self.traffic.total_tokens  # the API's slope
        q = self.server_capacity_tokens_month
        fixed, per_server = self.hardware.fixed_usd_month, self.hardware.per_server_usd_month
        margin = a * q - per_server
        common = dict(api_usd_per_token=a, server_capacity_tokens_month=q,
                      fixed_usd_month=fixed, per_server_usd_month=per_server,
                      margin_usd_per_server_month=margin)
        if margin <= 0:
            if a == 0:
                reason = "the API costs nothing per token, so no volume pays for a server"
            else:
                reason = (f"a fully used server replaces ${a * q:,.0f} of API spend a month "
                          f"but costs ${per_server:,.0f} a month to own and run, so the API "
                          f"is cheaper per token than the marginal self-hosted token: more "
                          f"volume only adds servers and the gap never closes")
            return Breakeven(never=True, reason=reason, **common)

        def cost(k: int) -> float:
            return fixed + k * per_server

        def bottom(k: int) -> float:
            return 0.0 if k == self.min_servers else (k - 1) * q

        first_k = max(self.min_servers, math.floor(fixed / margin) + 1)
        first_v = max(bottom(first_k), cost(first_k) / a)
        # The API is cheaper again just above k Q while F + (k + 1) c >= a k Q, i.e. for
        # k <= (F + c) / m; each such step adds two crossings.
        last_relapse = max(first_k - 1, math.floor((fixed + per_server) / margin))
        relapses = last_relapse - first_k + 1
        crossings = [Crossing(first_v, "self-hosted", first_k)]
        k = first_k
        while k <= last_relapse and len(crossings) < _MAX_CROSSINGS_LISTED:
            crossings.append(Crossing(k * q, "api", k + 1))
            crossings.append(Crossing(cost(k + 1) / a, "self-hosted", k + 1))
            k += 1
        stable_v = cost(last_relapse + 1) / a if relapses > 0 else first_v
        reason = (f"a full server saves ${margin:,.0f} a month against the API; the fixed "
                  f"${fixed:,.0f} a month is covered from {first_k} server(s) on")
        return Breakeven(never=False, reason=reason, first_tokens_month=first_v,
                         stable_tokens_month=stable_v, servers_at_first=first_k,
                         crossings=tuple(crossings[:_MAX_CROSSINGS_LISTED]),
                         num_crossings=1 + 2 * relapses, **common)

    def payback(self, against: str = "api") -> Payback:
        """Months for the servers this traffic needs to pay for themselves against the API
        (``against="api"``) or renting the same GPUs (``"cloud"``): the tutorial's question,
        asked at the same traffic and guarded (:ref:`ch07-three-ways`)."""
        costs = self.costs()
        if against == "api":
            alternative = costs.api_usd
        elif against == "cloud":
            if costs.cloud_usd is None:
                raise ParameterError("against", "this scenario has no cloud prices")
            alternative = costs.cloud_usd
        else:
            raise ParameterError("against", f"against must be 'api' or 'cloud', got {against!r}")
        month = costs.self_hosted
        saving = alternative - month.opex_usd
        if saving <= 0:
            reason = (f"running the servers costs ${month.opex_usd:,.0f} a month (power, "
                      f"colocation, staff) and the {against} ${alternative:,.0f}: there is "
                      f"no monthly saving to pay back ${month.capex_usd:,.0f} with")
            return Payback(True, reason, month.capex_usd, saving, None, False)
        months = month.capex_usd / saving
        life = self.hardware.depreciation_years * 12
        return Payback(False, f"${saving:,.0f} saved a month", month.capex_usd, saving,
                       months, months <= life)

