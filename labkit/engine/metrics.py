"""The teaching engine's Prometheus metrics, with vLLM's names (chapter 2, :ref:`ch08-metrics`).

Dashboards and alerts written for vLLM (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds`` ...) work unchanged
against ``labkit serve``: same names, types, bucket edges and label names. vLLM labels every
series with ``model_name`` and ``engine``, the index of the engine core behind the server (one
per data-parallel rank); the teaching engine is a single core, engine ``"0"``.

The series are fed from the engine's own records of each step
(:class:`~labkit.engine.stats.SchedulerStats` and :class:`~labkit.engine.stats.IterationStats`),
as vLLM's ``PrometheusStatLogger.record`` is: gauges take the scheduler's state, counters add
the step's counts, histograms observe the step's latencies. An engine that speculates also
exports vLLM's ``vllm:spec_decode_*`` counters (``vllm/v1/spec_decode/metrics.py``), from its
:class:`~labkit.engine.stats.SpecDecodingStats`: the acceptance rate is
``rate(vllm:spec_decode_num_accepted_tokens_total) /
rate(vllm:spec_decode_num_draft_tokens_total)``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from labkit.engine.stats import IterationStats, SchedulerStats, SpecDecodingStats

# vLLM's own bucket edges, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """Counters, gauges and histograms of one served model, in their own registry;
    ``num_speculative_tokens`` for an engine that speculates (the per-position counters
    have one series per draft position, as vLLM's)."""

    def __init__(self, model_name: str, num_speculative_tokens: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 %.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency.",
                             E2E_BUCKETS)
        self.spec_counters: tuple[Counter, Counter, Counter] | None = None
        self.spec_accepted_per_pos: list[Counter] = []
        if num_speculative_tokens is not None:
            self.spec_counters = (
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."))
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.",
                              [*labels, "position"], registry=r)
            self.spec_accepted_per_pos = [per_pos.labels(**labels, position=str(i))
                                          for i in range(num_speculative_tokens)]

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats | None = None,
               spec_decoding_stats: SpecDecodingStats | None = None) -> None:
        """Bring the metrics up to date with one step's records (vLLM's ``record``); without
        ``iteration_stats`` (an abort, a sleep) only the gauges move."""
        if spec_decoding_stats is not None and self.spec_counters is not None:
            drafts, draft_tokens, accepted = self.spec_counters
            drafts.inc(spec_decoding_stats.num_drafts)
            draft_tokens.inc(spec_decoding_stats.num_draft_tokens)
            accepted.inc(spec_decoding_stats.num_accepted_tokens)
            for counter, count in zip(self.spec_accepted_per_pos,
                                      spec_decoding_stats.num_accepted_tokens_per_pos,
                                      strict=True):
                counter.inc(count)
        self.running.set(scheduler_stats.num_running_reqs)
        self.waiting.set(scheduler_stats.num_waiting_reqs)
        self.kv_usage.set(scheduler_stats.kv_cache_usage)
        self.prefix_queries.inc(scheduler_stats.prefix_cache_stats.queries)
        self.prefix_hits.inc(scheduler_stats.prefix_cache_stats.hits)
        if iteration_stats is None:
            return
        self.preemptions.inc(iteration_stats.num_preempted_reqs)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for histogram, values in ((self.ttft, iteration_stats.time_to_first_tokens_iter),
                                  (self.itl, iteration_stats.inter_token_latencies_iter),
                                  (self.e2e, iteration_stats.e2e_latencies_iter)):
            for value in values:
                histogram.observe(value)
