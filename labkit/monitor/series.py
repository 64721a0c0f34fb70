"""Scraped samples over time, and PromQL's arithmetic on them, in Python
(:ref:`ch08-rates-quantiles`).

A Prometheus server keeps every scraped sample as ``(timestamp, value)`` in a series named by
its metric name and labels; dashboards and alerts then ask PromQL for ``rate()``,
``increase()`` and ``histogram_quantile()``. :class:`SeriesStore` is that store in memory,
and the functions here reproduce PromQL's math exactly, so that a lab without Prometheus gets
the same numbers as one with it, and a test can hold one against the other.

The reference is Prometheus v3.9.1 (released 2026-01-07), prometheus/prometheus:

* ``promql/functions.go``, ``extrapolatedRate``: ``rate()`` and ``increase()`` on float
  samples. Samples inside the window ``(t - range, t]`` (left-open since Prometheus 3.0;
  2.x included a sample exactly at ``t - range``), counter resets added back, then the
  difference between the first and last sample extrapolated towards the window's edges:
  all the way to an edge that lies within 1.1 average sample intervals, else half an
  interval; and for a counter never past the point where it would have been zero.
  Without anchored/smoothed selectors and created timestamps, both experimental.
* ``promql/quantile.go``, ``BucketQuantile``: ``histogram_quantile()`` on classic
  histogram buckets (cumulative counts with an ``le`` upper bound).
* ``promql/engine.go``: an instant selector looks back ``defaultLookbackDelta`` = 5 minutes
  for the newest sample.

Times are seconds (floats) on whatever clock the scraper was given; Prometheus uses integer
milliseconds, which changes nothing here but rounding.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from labkit.checks import ParameterError, in_range

#: PromQL's ``--query.lookback-delta`` default (``defaultLookbackDelta``, promql/engine.go).
LOOKBACK_DELTA_S = 300.0
#: ``smallDeltaTolerance`` in promql/quantile.go: neighbouring bucket counts this close
#: (relatively) are float noise, not observations.
SMALL_DELTA_TOLERANCE = 1e-12
#: Extrapolate to a window edge only when it lies within this many average sample
#: intervals of the nearest sample ("up to 10% more", extrapolatedRate).
EXTRAPOLATION_THRESHOLD = 1.1

#: A series' labels, sorted by name, hashable.
Labels = tuple[tuple[str, str], ...]


def labels_of(mapping: Mapping[str, str]) -> Labels:
    """``mapping`` as the sorted, hashable label tuple every series is keyed by."""
    return tuple(sorted((str(k), str(v)) for k, v in mapping.items()))


@dataclass(frozen=True)
class Sample:
    """One scraped value at one time (seconds)."""

    t_s: float
    value: float


@dataclass
class Series:
    """One time series: a metric name, its labels, and its samples in time order."""

    name: str
    labels: Labels
    samples: list[Sample] = field(default_factory=list)

    def window(self, start_s: float, end_s: float) -> list[Sample]:
        """The samples with ``start_s < t <= end_s`` (PromQL's range selector)."""
        times = [s.t_s for s in self.samples]
        return self.samples[bisect.bisect_right(times, start_s):bisect.bisect_right(times, end_s)]

    def latest(self, at_s: float, lookback_s: float = LOOKBACK_DELTA_S) -> Sample | None:
        """The newest sample with ``at_s - lookback_s < t <= at_s`` (an instant selector)."""
        found = self.window(at_s - lookback_s, at_s)
        return found[-1] if found else None


class SeriesStore:
    """Every scraped series, in memory: a tiny Prometheus TSDB for one lab (chapter 8).

    Samples of one series must arrive in time order, as scrapes do. ``retention_s`` drops
    samples older than that many seconds before the newest one (``None`` keeps all).
    """

    def __init__(self, retention_s: float | None = None) -> None:
        if retention_s is not None:
            in_range("retention_s", retention_s, 0, low_open=True)
        self.retention_s = retention_s
        self._series: dict[tuple[str, Labels], Series] = {}

    def add(self, name: str, labels: Mapping[str, str], t_s: float, value: float) -> None:
        """Append one sample to series ``name{labels}``."""
        if not isinstance(name, str) or not name:
            raise ParameterError("name", f"name must be a non-empty metric name, got {name!r}")
        in_range("t_s", t_s)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ParameterError("value", f"value must be a real number, got {value!r}")
        key = (name, labels_of(labels))
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = Series(name, key[1])
        if series.samples and t_s <= series.samples[-1].t_s:
            raise ParameterError("t_s", f"t_s must be later than the last sample of "
                                        f"{name} ({series.samples[-1].t_s}), got {t_s}")
        series.samples.append(Sample(float(t_s), float(value)))
        if self.retention_s is not None:
            keep_from = bisect.bisect_left([s.t_s for s in series.samples],
                                           t_s - self.retention_s)
            del series.samples[:keep_from]

    def select(self, name: str, **matchers: str) -> list[Series]:
        """The series named ``name`` whose labels equal ``matchers`` (``name{k="v"}``)."""
        return [s for (n, labels), s in self._series.items()
                if n == name and all(dict(labels).get(k) == v for k, v in matchers.items())]

    def names(self) -> list[str]:
        return sorted({n for n, _ in self._series})


# -- rate() and increase() ------------------------------------------------------------------


def extrapolated_delta(samples: Sequence[Sample], start_s: float, end_s: float, *,
                       is_counter: bool = True) -> float | None:
    """How much the series grew over the window ``(start_s, end_s]``, PromQL's way
    (``extrapolatedRate`` in promql/functions.go, v3.9.1; chapter 8).

    ``samples`` are those inside the window, in time order. Fewer than two give ``None``
    (PromQL returns no value). For a counter, every drop is a restart from zero, so the
    value before the drop is added back. The raw difference covers only first-to-last
    sample; it is scaled up to cover the gap to each window edge when that gap is under 1.1
    average sample intervals, otherwise by half an interval (the series probably began or
    ended inside the window). A counter is never extrapolated back past its zero.
    """
    if end_s <= start_s:
        raise ParameterError("end_s", f"end_s must be after start_s ({start_s}), got {end_s}")
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    if first.t_s <= start_s or last.t_s > end_s:
        raise ParameterError("samples", "samples must lie inside the window (start_s, end_s]")
    result = last.value - first.value
    if is_counter:
        result += sum(prev.value for prev, cur in zip(samples[:-1], samples[1:], strict=True)
                      if cur.value < prev.value)
    to_start, to_end = first.t_s - start_s, end_s - last.t_s
    sampled = last.t_s - first.t_s
    average = sampled / (len(samples) - 1)
    threshold = average * EXTRAPOLATION_THRESHOLD
    if to_start >= threshold:
        to_start = average / 2
    if is_counter:
        # A counter at value v growing by `result` over `sampled` seconds was zero
        # sampled * v / result seconds before the first sample: no earlier than that.
        to_zero = (sampled * first.value / result
                   if result > 0 and first.value >= 0 else to_start)
        to_start = min(to_start, to_zero)
    if to_end >= threshold:
        to_end = average / 2
    return result * (sampled + to_start + to_end) / sampled


def increase(series: Series, window_s: float, at_s: float) -> float | None:
    """PromQL ``increase(series[window_s])`` evaluated at ``at_s`` (chapter 8)."""
    in_range("window_s", window_s, 0, low_open=True)
    return extrapolated_delta(series.window(at_s - window_s, at_s), at_s - window_s, at_s)


def rate(series: Series, window_s: float, at_s: float) -> float | None:
    """PromQL ``rate(series[window_s])`` at ``at_s``: the increase per second (chapter 8)."""
    grown = increase(series, window_s, at_s)
    return None if grown is None else grown / window_s


# -- histogram_quantile() ------------------------------------------------------------------


def bucket_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """PromQL ``histogram_quantile(q, ...)`` on one classic histogram (chapter 8).

    ``buckets`` are ``(upper_bound, cumulative_count)`` pairs, any order, one of them
    ``+Inf``: a scrape's ``_bucket`` samples, or their ``rate()``. The math is
    ``BucketQuantile`` in promql/quantile.go (Prometheus v3.9.1): find the bucket where the
    rank ``q * total`` falls and interpolate linearly inside it; the lowest bucket starts
    at 0 when its upper bound is positive (and is returned as is when not); a rank in the
    ``+Inf`` bucket returns the highest finite bound. Counts that dip from one bucket to
    the next (float noise, or a scrape that raced an observation) are lifted to the
    previous bucket's count. Like PromQL this never raises on data: ``q < 0`` gives
    ``-inf``, ``q > 1`` gives ``+inf``; NaN comes from ``q`` NaN, no ``+Inf`` bucket, fewer
    than two buckets, or no observations. Only a non-number raises ParameterError.
    """
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        raise ParameterError("q", f"q must be a real number, got {q!r}")
    pairs = []
    for pair in buckets:
        try:
            upper, count = (float(x) for x in pair)
        except (TypeError, ValueError):
            raise ParameterError("buckets", f"buckets must be (upper_bound, count) pairs of "
                                            f"numbers, got {pair!r}") from None
        pairs.append([upper, count])
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if not pairs:
        return math.nan
    pairs.sort(key=lambda p: p[0])
    if pairs[-1][0] != math.inf:
        return math.nan
    merged: list[list[float]] = []  # the same bound twice (coalesceBuckets): one bucket
    for upper, count in pairs:
        if merged and merged[-1][0] == upper:
            merged[-1][1] += count
        else:
            merged.append([upper, count])
    _make_monotonic(merged)
    if len(merged) < 2:
        return math.nan
    total = merged[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    # The first bucket (the +Inf one excluded) whose cumulative count reaches the rank.
    b = next((i for i, (_, count) in enumerate(merged[:-1]) if count >= rank), len(merged) - 1)
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    start, count = 0.0, merged[b][1]
    if b > 0:
        start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    return start + (merged[b][0] - start) * (rank / count)


def _make_monotonic(buckets: list[list[float]]) -> None:
    """Counts that differ from the last kept one by float noise take its value; counts
    that fall below it are lifted to it (``ensureMonotonicAndIgnoreSmallDeltas``)."""
    previous = buckets[0][1]
    for bucket in buckets[1:]:
        count = bucket[1]
        if count == previous:
            continue
        if _almost_equal(previous, count) or count < previous:
            bucket[1] = previous
        else:
            previous = count


def _almost_equal(a: float, b: float) -> bool:
    """util/almost ``Equal(a, b, SMALL_DELTA_TOLERANCE)``: relative difference, with the
    smallest normal float as the scale when either side is zero."""
    min_normal = 2.2250738585072014e-308
    if a == b:
        return True
    abs_sum, diff = abs(a) + abs(b), abs(a - b)
    if a == 0 or b == 0 or abs_sum < min_normal:
        return diff < SMALL_DELTA_TOLERANCE * min_normal
    return diff / min(abs_sum, 1.7976931348623157e308) < SMALL_DELTA_TOLERANCE


def histogram_quantile(q: float, store: SeriesStore, name: str, at_s: float, *,
                       window_s: float | None = None, by: Sequence[str] = (),
                       **matchers: str) -> dict[Labels, float]:
    """``histogram_quantile(q, sum by (le, <by>) (rate(<name>_bucket{matchers}[window])))``
    at ``at_s``, one value per group of the ``by`` labels (chapter 8).

    ``name`` is the histogram's name without ``_bucket``
    (``vllm:time_to_first_token_seconds``). With ``window_s`` the quantile is over the
    observations of the last ``window_s`` seconds, as dashboards and alerts ask; without,
    over everything since the server started (the latest cumulative counts). A group whose
    buckets have no rate yet (fewer than two samples in the window) is left out, as PromQL
    leaves it out.
    """
    in_range("at_s", at_s)
    if window_s is not None:
        in_range("window_s", window_s, 0, low_open=True)
    groups: dict[Labels, dict[float, float]] = {}
    for series in store.select(name + "_bucket", **matchers):
        labels = dict(series.labels)
        if "le" not in labels:
            continue
        try:
            upper = float(labels["le"])
        except ValueError:
            raise ParameterError("le", f"le must be a number or +Inf, got "
                                       f"{labels['le']!r} in {name}_bucket") from None
        if window_s is None:
            newest = series.latest(at_s)
            value = None if newest is None else newest.value
        else:
            value = rate(series, window_s, at_s)
        if value is None:
            continue
        key = tuple((k, labels.get(k, "")) for k in by)
        buckets = groups.setdefault(key, {})
        buckets[upper] = buckets.get(upper, 0.0) + value
    return {key: bucket_quantile(q, buckets.items()) for key, buckets in groups.items()}


def sum_rate(store: SeriesStore, name: str, window_s: float, at_s: float, *,
             by: Sequence[str] = (), **matchers: str) -> dict[Labels, float]:
    """``sum by (<by>) (rate(<name>{matchers}[window_s]))`` at ``at_s`` (chapter 8); series
    with fewer than two samples in the window add nothing, groups with none are absent."""
    out: dict[Labels, float] = {}
    for series in store.select(name, **matchers):
        value = rate(series, window_s, at_s)
        if value is not None:
            labels = dict(series.labels)
            key = tuple((k, labels.get(k, "")) for k in by)
            out[key] = out.get(key, 0.0) + value
    return out


def latest_values(store: SeriesStore, name: str, at_s: float,
                  **matchers: str) -> dict[Labels, float]:
    """The instant vector ``<name>{matchers}`` at ``at_s``: each series' newest sample
    within the 5-minute lookback, keyed by its labels (chapter 8)."""
    in_range("at_s", at_s)
    out = {}
    for series in store.select(name, **matchers):
        newest = series.latest(at_s)
        if newest is not None:
            out[series.labels] = newest.value
    return out
