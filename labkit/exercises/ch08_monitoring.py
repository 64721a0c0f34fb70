"""Checks for the exercises of lab 08, monitoring (``labs/08_monitoring.ipynb``, chapter 8).

Every expected value comes from :mod:`labkit.monitor` itself, the code whose PromQL math the
tests hold against the real Prometheus: :func:`~labkit.monitor.series.bucket_quantile` for
the quantile, :func:`~labkit.monitor.promql.evaluate` for the student's PromQL, and
:class:`~labkit.monitor.alerts.RuleEvaluator` for when an alert fires. The mistakes they name:

- a quantile "over the last minute" taken from the cumulative counts (everything since the
  server started) instead of their increase over the window, which is why PromQL wraps the
  buckets in ``rate()``; the bucket's upper or lower bound given instead of interpolating;
- in the alert's expression ``>=`` for "more than", the ``instance`` label summed away (the
  page cannot say which server), ``rate()`` of a gauge, and names vLLM does not export
  (``vllm:gpu_cache_usage_perc`` and the like, found by
  :func:`~labkit.monitor.conformance.lint_queries`);
- for the firing time: ``for:`` counted from the moment the queue rose, or from the scrape
  that saw it, instead of from the evaluation that first found the condition true.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from labkit.checks import ParameterError, in_range
from labkit.grading import Feedback, check_number
from labkit.monitor.alerts import RuleEvaluator, waiting_queue_above
from labkit.monitor.conformance import lint_queries
from labkit.monitor.promql import UnsupportedQuery, evaluate
from labkit.monitor.series import SeriesStore, bucket_quantile

INF = math.inf

#: Exercise 1: ``vllm:time_to_first_token_seconds_bucket`` of one server, cumulative counts
#: by upper bound, at two scrapes a minute apart. Calm before (fast first tokens), a burst of
#: slow ones in between.
TTFT_BEFORE = {0.1: 30.0, 0.25: 38.0, 0.5: 40.0, 1.0: 40.0, 2.5: 40.0, INF: 40.0}
TTFT_AFTER = {0.1: 40.0, 0.25: 68.0, 0.5: 85.0, 1.0: 92.0, 2.5: 100.0, INF: 100.0}


def _p(q: float, buckets: Mapping[float, float]) -> float:
    return bucket_quantile(q, buckets.items())


def check_p99_over_window(answer: object, before: Mapping[float, float] = TTFT_BEFORE,
                          after: Mapping[float, float] = TTFT_AFTER,
                          q: float = 0.99) -> Feedback:
    """Exercise 1: the ``q`` quantile of TTFT (seconds) over the minute between two scrapes
    of the cumulative bucket counts ``before`` and ``after``, as
    ``histogram_quantile(q, increase(...[1m]))`` computes it: the counts' increase per
    bucket, the bucket where rank ``q * total`` falls, linear interpolation inside it."""
    in_range("q", q, 0, 1)
    if set(before) != set(after) or INF not in after:
        raise ParameterError("after", "before and after must have the same bucket bounds, "
                                      "+Inf among them")
    window = {le: after[le] - before[le] for le in after}
    expected = _p(q, window)
    bounds = sorted(window)
    rank = q * window[INF]
    upper = next(le for le in bounds if window[le] >= rank)
    lower = bounds[bounds.index(upper) - 1] if bounds.index(upper) else 0.0
    mistakes = {"used the cumulative counts since the server started, not their increase "
                "over the window (PromQL's rate() inside histogram_quantile)": _p(q, after),
                "gave the bucket's upper bound without interpolating": upper,
                "gave the bucket's lower bound without interpolating": lower,
                f"took rank (1 - q) * total, the p{(1 - q) * 100:g}": _p(1 - q, window)}
    mistakes = {k: v for k, v in mistakes.items() if not math.isclose(v, expected)}
    return check_number(answer, expected, what=f"p{q * 100:g} TTFT over the window",
                        unit="s", rel_tol=1e-3, mistakes=mistakes)


#: Exercise 2: three servers' ``vllm:num_requests_waiting`` at one instant.
QUEUES = {"10.0.0.1:8000": 6.0, "10.0.0.2:8000": 5.0, "10.0.0.3:8000": 0.0}


def _queue_store(queues: Mapping[str, float]) -> SeriesStore:
    store = SeriesStore()
    for instance, waiting in queues.items():
        labels = {"instance": instance, "job": "vllm", "model_name": "llama", "engine": "0"}
        store.add("vllm:num_requests_waiting", labels, 0.0, waiting)
        store.add("vllm:num_requests_running", labels, 0.0, 8.0)
    return store


def check_queue_alert_promql(answer: object, threshold: float = 5,
                             queues: Mapping[str, float] = QUEUES) -> Feedback:
    """Exercise 2: the PromQL of an alert "more than ``threshold`` requests waiting on a
    server". The answer is evaluated on ``queues`` (one sample per server) with
    labkit.monitor's evaluator; right when it returns exactly the servers above the
    threshold, each still labelled with its ``instance``."""
    in_range("threshold", threshold, 0)
    if answer is None:
        return Feedback(False, "Not answered yet: write the alert's PromQL as a string.")
    if not isinstance(answer, str) or not answer.strip():
        return Feedback(False, f"The answer must be a PromQL string, got {answer!r}.")
    findings = lint_queries({"answer": answer})
    if findings:
        return Feedback(False, "Not quite: " + "; ".join(f.message for f in findings) + ".")
    try:
        result = evaluate(_queue_store(queues), answer, 0.0)
    except UnsupportedQuery:
        return Feedback(False, "labkit evaluates a few PromQL shapes only (a selector, "
                               "sum by (...) of one, rate(), then a comparison such as "
                               "'> 5'): write the condition in one of them.")
    if any(isinstance(v, list) for v in result.values()):
        return Feedback(False, "Not quite: that is a range vector (samples over a window); "
                               "an alert compares one value per server.")
    wanted = {i for i, waiting in queues.items() if waiting > threshold}
    got = {dict(labels).get("instance") for labels in result}
    if got == wanted:
        return Feedback(True, f"Correct: it flags {sorted(wanted)}, each with its instance "
                              f"label, and only those.")
    if None in got:
        return Feedback(False, "Not quite: the result has lost the instance label (a sum or "
                               "an average without 'by (instance)'): the alert cannot say "
                               "which server to look at.")
    at_threshold = {i for i, waiting in queues.items() if waiting == threshold}
    if got == wanted | at_threshold and at_threshold:
        return Feedback(False, f"Not quite: it also flags a server with exactly {threshold:g} "
                               f"waiting, which is not more than {threshold:g} (>= where > "
                               f"belongs).")
    if "rate(" in answer.replace(" ", ""):
        return Feedback(False, "Not quite: vllm:num_requests_waiting is a gauge (a level, "
                               "not a count that only grows): compare it directly; rate() of "
                               "a gauge is meaningless.")
    return Feedback(False, f"Not quite: it flags {sorted(got) or 'no server'}, but the "
                           f"servers with more than {threshold:g} waiting are "
                           f"{sorted(wanted)}.")


def alert_fire_time(*, rise_s: float = 2.0, for_s: float = 30.0,
                    scrape_interval_s: float = 15.0, scrape_offset_s: float = 0.0,
                    evaluation_interval_s: float = 15.0,
                    evaluation_offset_s: float = 7.0) -> float:
    """When a queue alert with ``for: for_s`` first fires (seconds), when the queue jumps
    above its threshold at ``rise_s`` and stays there; scrapes at ``scrape_offset_s + k *
    scrape_interval_s``, rule evaluations at ``evaluation_offset_s + k *
    evaluation_interval_s`` (Prometheus runs both on their own timers). Computed with
    :class:`~labkit.monitor.alerts.RuleEvaluator` on the samples those scrapes take."""
    for name, value in (("rise_s", rise_s), ("for_s", for_s),
                        ("scrape_offset_s", scrape_offset_s),
                        ("evaluation_offset_s", evaluation_offset_s)):
        in_range(name, value, 0)
    in_range("scrape_interval_s", scrape_interval_s, 0, low_open=True)
    in_range("evaluation_interval_s", evaluation_interval_s, 0, low_open=True)
    horizon = rise_s + for_s + 2 * (scrape_interval_s + evaluation_interval_s) + 1
    store = SeriesStore()
    labels = {"instance": "10.0.0.1:8000", "job": "vllm"}
    rule = waiting_queue_above(5, for_s=for_s)
    evaluator = RuleEvaluator([rule], store)
    scrapes = [scrape_offset_s + k * scrape_interval_s
               for k in range(math.ceil(horizon / scrape_interval_s) + 1)]
    evaluations = [evaluation_offset_s + k * evaluation_interval_s
                   for k in range(math.ceil(horizon / evaluation_interval_s) + 1)]
    # Scrapes and evaluations in time order; a scrape at the same instant goes first.
    for t_s, kind in sorted([(t, 0) for t in scrapes] + [(t, 1) for t in evaluations]):
        if kind == 0:
            store.add("vllm:num_requests_waiting", labels, t_s, 20.0 if t_s >= rise_s else 0.0)
        elif any(e.state == "firing" for e in evaluator.evaluate(t_s)):
            return t_s
    raise ParameterError("for_s", "the alert did not fire within the horizon")


def check_alert_fire_time(answer: object, *, rise_s: float = 2.0, for_s: float = 30.0,
                          scrape_interval_s: float = 15.0, scrape_offset_s: float = 0.0,
                          evaluation_interval_s: float = 15.0,
                          evaluation_offset_s: float = 7.0) -> Feedback:
    """Exercise 3: the time (seconds) at which the queue alert first fires; see
    :func:`alert_fire_time` for the setting."""
    timing = dict(rise_s=rise_s, for_s=for_s, scrape_interval_s=scrape_interval_s,
                  scrape_offset_s=scrape_offset_s, evaluation_interval_s=evaluation_interval_s,
                  evaluation_offset_s=evaluation_offset_s)
    expected = alert_fire_time(**timing)
    first_scrape = scrape_offset_s + scrape_interval_s * math.ceil(
        (rise_s - scrape_offset_s) / scrape_interval_s)
    first_eval_after_rise = evaluation_offset_s + evaluation_interval_s * math.ceil(
        (rise_s - evaluation_offset_s) / evaluation_interval_s)
    mistakes = {
        "counted for: from the moment the queue rose": rise_s + for_s,
        "counted for: from the scrape that first saw the queue, not from the evaluation "
        "that found the condition true": first_scrape + for_s,
        "let the first evaluation after the rise see it, before any scrape had": (
            first_eval_after_rise + for_s),
        "waited one evaluation too many: firing needs 'active for >= for', not '>'": (
            expected + evaluation_interval_s),
    }
    mistakes = {k: v for k, v in mistakes.items() if v != expected}
    return check_number(answer, expected, what="the time the alert fires", unit="s",
                        rel_tol=1e-6, mistakes=mistakes)
