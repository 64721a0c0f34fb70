"""Autoscaling, simulated: a fleet of chapter 3's simulated servers under a policy
(:ref:`ch05-hpa-kpa-keda`).

Each replica is a vLLM-style engine from chapter 3, built from a
:class:`~labkit.simulate.deployment.Deployment` (the replica record chapter 6 prices too): a
:class:`~labkit.scheduling.Scheduler` over a :class:`~labkit.kvcache.KVCacheManager` sized by
:func:`~labkit.hardware.plan_kv_cache`, its steps timed by the roofline
(:class:`~labkit.simulate.RooflineCost`) and taken by the fast simulator's stepper
(:mod:`labkit.simulate.fast`), the scheduler's own code. Around them:

- a gateway routes each request, as it arrives, to the least-loaded ready replica (fewest
  requests in flight; or round robin); with no replica ready it holds the request until one
  is, and the wait counts in the request's TTFT;
- every ``policy.sync_period_s`` the policy sees the fleet (:class:`~labkit.autoscale.Observation`:
  per replica ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc``, GPU utilization as DCGM measures it, average concurrency)
  and says how many replicas there should be;
- a new replica becomes ready ``cold_start_s`` after it is asked for (it is billed from
  then: the GPU is held while the model loads); a replica scaled away stops taking
  requests, finishes those it has, then stops (a graceful drain). Replicas go in the
  ReplicaSet controller's order: those not ready first, then the most recently ready.

Outputs: each request's TTFT (p99, attainment of a TTFT SLO), replica-hours (what chapter 6
prices) and a timeline of the replica count. Everything is seeded and nothing sleeps: an hour
of traffic simulates in seconds.

What is simplified: a replica's state is read between its steps (a step lasts milliseconds);
prefix caching is off (trace prompts share nothing); GPU time and concurrency are charged
to the sync interval in which a step starts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from labkit.autoscale.observation import (CONCURRENCY, GPU_UTILIZATION, KV_CACHE_USAGE, RUNNING,
                                          WAITING, Observation, PodMetrics, Policy)
from labkit.checks import ParameterError, in_range, positive_int
from labkit.scheduling import Request
from labkit.simulate import Workload, random_length_bounds, random_lengths
from labkit.simulate.deployment import Deployment
# The fast simulator's stepper takes one step of one engine at a time, which is what a fleet
# needs; its module keeps it private because simulate() is its only other user.
from labkit.simulate.fast import cyclic_gc_paused, FastSimulator

#: vLLM serving meta-llama/Llama-3.1-8B-Instruct on an L40S, from a new pod to its first
#: request, step by step (seconds): ``(caches kept on a volume, clean pod)``. Source:
#: Tensorfuse, "Reducing GPU cold start" (tensorfuse.io/docs/blogs/reducing_gpu_cold_start,
#: 2025-09-01). Node provisioning and the image pull are not in it: they come on top when the
#: cluster has no GPU node free, or the node has never pulled vLLM's image.
COLD_START_STEPS_S = {"model download": (0.0, 61.0), "weight loading": (18.0, 33.0),
                      "Dynamo bytecode transform": (10.0, 10.0),
                      "graph compilation": (13.0, 42.0), "graph capture": (7.0, 54.0),
                      "engine init and imports": (34.0, 94.0)}

COLD_START_S = sum(cached for cached, _ in COLD_START_STEPS_S.values())
"""Seconds from asking for a replica to its first request, caches on a volume (82 s):
the fleet's default cold start (:data:`COLD_START_STEPS_S`)."""

CLEAN_POD_START_S = sum(clean for _, clean in COLD_START_STEPS_S.values())
"""The same start from a clean pod, which downloads the weights and compiles (294 s)."""


# ---------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------

def trace_from_rate(rate: Callable[[np.ndarray], np.ndarray], peak_rate: float,
                    duration_s: float, *, input_len: int = 1024, output_len: int = 128,
                    range_ratio: float = 0.0, seed: int = 0) -> Workload:
    """A :class:`~labkit.simulate.Workload` of Poisson arrivals whose rate (requests/s)
    follows ``rate(t)``, never above ``peak_rate``, over ``duration_s`` (chapter 5).

    Drawn by thinning: a Poisson process at ``peak_rate`` keeps each arrival at ``t`` with
    probability ``rate(t) / peak_rate``. Lengths follow ``vllm bench serve``'s random
    dataset (:func:`labkit.simulate.random_lengths`, vLLM's rule exactly), drawn after the
    arrivals from the same generator; its defaults are 1024 input and 128 output tokens with
    ``range_ratio`` 0.
    """
    in_range("peak_rate", peak_rate, 0, low_open=True)
    in_range("duration_s", duration_s, 0, low_open=True)
    random_length_bounds(input_len, output_len, range_ratio)  # fail before drawing
    rng = np.random.default_rng(seed)
    candidates = np.sort(rng.uniform(0.0, duration_s, rng.poisson(peak_rate * duration_s)))
    rates = np.asarray(rate(candidates), dtype=float)
    if np.any(rates > peak_rate * (1 + 1e-9)) or np.any(rates < 0):
        raise ParameterError("rate", f"rate(t) must stay within [0, peak_rate={peak_rate}]")
    arrivals = candidates[rng.uniform(0.0, peak_rate, len(candidates)) < rates]
    prompts, outputs = random_lengths(rng, len(arrivals), input_len, output_len, range_ratio)
    return Workload(arrivals, prompts, outputs, float(duration_s), seed=seed,
                    description=f"{len(arrivals)} requests in {duration_s:g} s, at most "
                                f"{peak_rate:g}/s")


def diurnal_trace(duration_s: float, peak_rate: float, trough_rate: float, *,
                  period_s: float | None = None, seed: int = 0, **lengths) -> Workload:
    """A day's cycle (chapter 5): the rate rises from ``trough_rate`` at t = 0 to
    ``peak_rate`` half a ``period_s`` later and back (a raised cosine); ``period_s`` defaults
    to the whole trace, one "day" compressed into it. ``lengths`` go to
    :func:`trace_from_rate`."""
    in_range("trough_rate", trough_rate, 0, peak_rate)
    period = in_range("period_s", duration_s if period_s is None else period_s, 0,
                      low_open=True)

    def rate(t: np.ndarray) -> np.ndarray:
        return trough_rate + (peak_rate - trough_rate) * (1 - np.cos(2 * np.pi * t / period)) / 2

    return trace_from_rate(rate, peak_rate, duration_s, seed=seed, **lengths)


def bursty_trace(duration_s: float, base_rate: float, burst_rate: float, *,
                 burst_every_s: float, burst_s: float, first_burst_s: float | None = None,
                 seed: int = 0, **lengths) -> Workload:
    """Bursty load (chapter 5): a steady ``base_rate`` with bursts of ``burst_rate`` lasting
    ``burst_s`` every ``burst_every_s`` seconds, the first at ``first_burst_s`` (default:
    after one period less the burst, so the trace starts calm). ``lengths`` go to
    :func:`trace_from_rate`."""
    in_range("base_rate", base_rate, 0)
    in_range("burst_rate", burst_rate, base_rate, low_open=True)
    in_range("burst_every_s", burst_every_s, 0, low_open=True)
    in_range("burst_s", burst_s, 0, burst_every_s, low_open=True)
    first = burst_every_s - burst_s if first_burst_s is None else first_burst_s
    in_range("first_burst_s", first, 0)

    def rate(t: np.ndarray) -> np.ndarray:
        in_burst = (t >= first) & (np.mod(t - first, burst_every_s) < burst_s)
        return np.where(in_burst, burst_rate, base_rate)

    return trace_from_rate(rate, burst_rate, duration_s, seed=seed, **lengths)


def step_trace(segments: Sequence[tuple[float, float]], *, seed: int = 0,
               **lengths) -> Workload:
    """Piecewise-constant load (chapter 5): ``segments`` of ``(duration_s, rate)`` one after
    another, e.g. ``[(300, 1.0), (600, 8.0), (300, 1.0)]`` for a step up and back down."""
    if not segments:
        raise ParameterError("segments", "segments must list at least one (duration_s, rate)")
    for duration, rate in segments:
        in_range("duration_s", duration, 0, low_open=True)
        in_range("rate", rate, 0)
    ends = np.cumsum([d for d, _ in segments])
    rates = np.array([r for _, r in segments], dtype=float)
    peak = max(rates.max(), 1e-9)
    return trace_from_rate(lambda t: rates[np.minimum(np.searchsorted(ends, t, side="right"),
                                                      len(rates) - 1)],
                           peak, float(ends[-1]), seed=seed, **lengths)


# ---------------------------------------------------------------------------------------------
# The fleet
# ---------------------------------------------------------------------------------------------

def _default_deployment() -> Deployment:
    return Deployment("Llama-3-8B", "L40S", max_model_len=8192)


@dataclass(frozen=True)
class FleetConfig:
    """The fleet (chapter 5): replicas of one :class:`~labkit.simulate.deployment.Deployment`
    (by default Llama-3-8B on one L40S, ``max_model_len`` 8192, vLLM's defaults), how long a
    new one takes to start, and how the gateway in front of them routes.

    ``cold_start_s`` runs from asking for a replica to its first request; ``routing`` is
    ``least_loaded`` (fewest requests in flight, lowest index on ties) or ``round_robin``.
    """

    deployment: Deployment = field(default_factory=_default_deployment)
    cold_start_s: float = COLD_START_S
    routing: str = "least_loaded"

    def __post_init__(self) -> None:
        in_range("cold_start_s", self.cold_start_s, 0)
        if self.routing not in ("least_loaded", "round_robin"):
            raise ParameterError("routing", f"routing must be 'least_loaded' or 'round_robin', "
                                            f"got {self.routing!r}")
        problem = self.deployment.problem()  # fail now, not mid-simulation
        if problem is not None:
            raise ParameterError("deployment", f"{self.deployment.label} cannot run: {problem}")


class _Replica:
    """One engine: a scheduler advanced step by step, and what a monitor would read from it."""

    def __init__(self, index: int, created_s: float, ready_s: float,
                 fleet: FleetConfig) -> None:
        self.index, self.created_s, self.ready_s = index, created_s, ready_s
        self.ready = False
        self.draining = False
        self.stopped_s: float | None = None
        self.scheduler = fleet.deployment.new_scheduler()
        self.stepper = FastSimulator(self.scheduler, fleet.deployment.step_cost)
        self.steps = 0
        self.clock = ready_s     # when the engine is next free to start a step
        self.busy_s = 0.0        # time spent in steps
        self.inflight_s = 0.0    # integral of requests in flight over time
        self.marks = (ready_s, 0.0, 0.0)  # (time, busy_s, inflight_s) at the last sync
        self.served = 0

    @property
    def live(self) -> bool:
        """Counted in ``spec.replicas``: starting or ready, not draining or stopped."""
        return not self.draining and self.stopped_s is None

    @property
    def in_flight(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def advance(self, until: float, on_finish: Callable[[Request], None]) -> None:
        """Run every step that starts before ``until`` (the last may end after it)."""
        sched, step = self.scheduler, self.stepper.step
        while self.clock < until and (sched.running or sched.waiting):
            start, in_flight = self.clock, len(sched.running) + len(sched.waiting)
            self.clock, _ = step(self.steps, start)
            self.steps += 1
            self.busy_s += self.clock - start
            self.inflight_s += in_flight * (self.clock - start)
            if sched.finished:
                for request in sched.finished:
                    on_finish(request)
                sched.finished.clear()  # done with: only their times are kept
        if not sched.has_unfinished_requests():
            if self.draining and self.stopped_s is None:
                self.stopped_s = self.clock
            self.clock = max(self.clock, until)

    def pod_metrics(self, now: float) -> PodMetrics:
        """What the replica exports at ``now``; nothing until its model is loaded."""
        if not self.ready:
            return PodMetrics(f"replica-{self.index}", False)
        since, busy, inflight = self.marks
        span = now - since
        self.marks = (now, self.busy_s, self.inflight_s)
        sched = self.scheduler
        return PodMetrics(f"replica-{self.index}", True, {
            WAITING: len(sched.waiting), RUNNING: len(sched.running),
            KV_CACHE_USAGE: sched.kv_cache.usage,
            GPU_UTILIZATION: 100 * min(1.0, (self.busy_s - busy) / span) if span > 0 else 0.0,
            CONCURRENCY: (self.inflight_s - inflight) / span if span > 0 else self.in_flight})


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaRecord:
    """One replica's life: asked for, ready (None if cancelled while starting), stopped (None
    if still up at the end), and how many requests it served."""

    index: int
    created_s: float
    ready_s: float | None
    stopped_s: float | None
    served: int


@dataclass(frozen=True)
class Timeline:
    """The fleet at every sync: desired replicas, and how many are ready, starting, draining;
    requests held at the gateway."""

    time_s: np.ndarray
    desired: np.ndarray
    ready: np.ndarray
    starting: np.ndarray
    draining: np.ndarray
    queued: np.ndarray


@dataclass(frozen=True)
class PolicySummary:
    """One policy on one trace, in a row (chapter 5; replica-hours feed chapter 6)."""

    policy: str
    requests: int
    p50_ttft_ms: float
    p99_ttft_ms: float
    slo_attainment: float
    replica_hours: float
    peak_replicas: int
    scale_changes: int


@dataclass(frozen=True)
class AutoscaleResult:
    """One simulation (chapter 5): every request's times, every replica's life, the fleet's
    timeline."""

    policy: str
    trace: Workload
    end_s: float
    routed_s: np.ndarray
    served_by: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    replicas: tuple[ReplicaRecord, ...]
    timeline: Timeline

    @property
    def ttft_ms(self) -> np.ndarray:
        """Arrival to first token, waiting at the gateway included."""
        return 1e3 * (self.first_token_s - self.trace.arrival_s)

    @property
    def e2el_ms(self) -> np.ndarray:
        return 1e3 * (self.finish_s - self.trace.arrival_s)

    def p99_ttft_ms(self) -> float:
        return float(np.percentile(self.ttft_ms, 99)) if len(self.trace) else 0.0

    def slo_attainment(self, ttft_slo_ms: float) -> float:
        """Share of requests whose TTFT met ``ttft_slo_ms``."""
        in_range("ttft_slo_ms", ttft_slo_ms, 0, low_open=True)
        return float(np.mean(self.ttft_ms <= ttft_slo_ms)) if len(self.trace) else 1.0

    @property
    def replica_seconds(self) -> float:
        """GPU time held: each replica from the moment it was asked for to its stop."""
        return sum((self.end_s if r.stopped_s is None else r.stopped_s) - r.created_s
                   for r in self.replicas)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600

    def summary(self, ttft_slo_ms: float) -> PolicySummary:
        ttft = self.ttft_ms
        desired = self.timeline.desired
        return PolicySummary(
            self.policy, len(self.trace),
            float(np.median(ttft)) if len(ttft) else 0.0, self.p99_ttft_ms(),
            self.slo_attainment(ttft_slo_ms), self.replica_hours,
            int(max(desired.max(initial=0), (self.timeline.ready + self.timeline.starting
                                             ).max(initial=0))),
            int(np.count_nonzero(np.diff(desired))))


# ---------------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------------

@dataclass
class _Run:
    """The state of one simulation: replicas, the gateway's queue, the records."""

    trace: Workload
    policy: Policy
    fleet: FleetConfig
    replicas: list[_Replica] = field(default_factory=list)
    queue: deque[int] = field(default_factory=deque)
    starting: list[tuple[float, int]] = field(default_factory=list)  # heap: (ready_s, index)
    rr: int = 0
    latency_sum_s: float = 0.0
    latency_count: int = 0
    timeline: list[tuple[float, int, int, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.trace)
        self.routed_s = np.full(n, np.nan)
        self.served_by = np.full(n, -1)
        self.first_token_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)

    def add_replica(self, now: float, ready_s: float) -> None:
        replica = _Replica(len(self.replicas), now, ready_s, self.fleet)
        self.replicas.append(replica)
        heapq.heappush(self.starting, (ready_s, replica.index))

    def finished(self, request: Request) -> None:
        i = int(request.request_id)
        self.first_token_s[i] = request.token_times[0]
        self.finish_s[i] = request.finish_time
        self.latency_sum_s += request.finish_time - request.arrival_time
        self.latency_count += 1

    def advance(self, now: float) -> None:
        for replica in self.replicas:
            if replica.stopped_s is None:
                replica.advance(now, self.finished)

    def route(self, i: int, now: float) -> None:
        ready = [r for r in self.replicas if r.ready and r.live]
        if not ready:
            self.queue.append(i)
            return
        if self.fleet.routing == "round_robin":
            replica = ready[self.rr % len(ready)]
            self.rr += 1
        else:
            replica = min(ready, key=lambda r: (r.in_flight, r.index))
        trace = self.trace
        replica.scheduler.add_request(Request(
            str(i), [0] * int(trace.prompt_lens[i]), [0] * int(trace.output_lens[i]),
            float(trace.arrival_s[i])))
        replica.served += 1
        self.routed_s[i], self.served_by[i] = now, replica.index

    def become_ready(self, index: int, now: float) -> None:
        replica = self.replicas[index]
        if replica.stopped_s is not None:  # cancelled while it started
            return
        replica.ready, replica.clock, replica.marks = True, now, (now, 0.0, 0.0)
        while self.queue:
            self.route(self.queue.popleft(), now)

    def observe(self, now: float) -> Observation:
        live = [r for r in self.replicas if r.live]
        latency = self.latency_sum_s / self.latency_count if self.latency_count else 0.0
        self.latency_sum_s, self.latency_count = 0.0, 0
        return Observation(len(live), tuple(r.pod_metrics(now) for r in live), len(self.queue),
                           1e3 * latency)

    def scale(self, desired: int, now: float) -> None:
        """Make ``desired`` replicas live: start new ones, or remove the ReplicaSet's choice
        (not ready first, newest first; then the most recently ready) and drain them."""
        positive_int(f"replicas from policy {self.policy.name!r}", desired, at_least=0)
        live = [r for r in self.replicas if r.live]
        for _ in range(desired - len(live)):
            self.add_replica(now, now + self.fleet.cold_start_s)
        victims = sorted(live, key=lambda r: (r.ready, -(r.ready_s if r.ready else r.created_s),
                                              -r.index))
        for replica in victims[:max(0, len(live) - desired)]:
            replica.draining = True
            if not replica.ready or not replica.scheduler.has_unfinished_requests():
                replica.stopped_s = now

    def record(self, now: float, desired: int) -> None:
        live = [r for r in self.replicas if r.live]
        draining = sum(r.draining and r.stopped_s is None for r in self.replicas)
        ready = sum(r.ready for r in live)
        self.timeline.append((now, desired, ready, len(live) - ready, draining, len(self.queue)))


def simulate_autoscaling(trace: Workload, policy: Policy, fleet: FleetConfig | None = None, *,
                         initial_replicas: int = 1, overrun_s: float = 3600.0) -> AutoscaleResult:
    """Run ``trace`` through a fleet that ``policy`` scales (chapter 5).

    The fleet starts with ``initial_replicas`` ready replicas; the policy is first asked at
    t = 0, then every ``policy.sync_period_s``, until the trace has ended and every request
    has finished. A policy that leaves requests unserved ``overrun_s`` after the trace ends
    (scaled to zero and never back) raises ``RuntimeError``.
    """
    fleet = fleet or FleetConfig()
    positive_int("initial_replicas", initial_replicas, at_least=0)
    in_range("overrun_s", overrun_s, 0)
    if trace.longest > fleet.deployment.max_model_len:
        raise ParameterError("trace", f"a request of {trace.longest} tokens exceeds "
                                      f"max_model_len={fleet.deployment.max_model_len}")
    run = _Run(trace, policy, fleet)
    for _ in range(initial_replicas):
        run.add_replica(0.0, 0.0)
    n, arrivals = len(trace), trace.arrival_s
    i, next_sync, last = 0, 0.0, 0.0
    with cyclic_gc_paused():
        while True:
            times = (run.starting[0][0] if run.starting else math.inf,
                     arrivals[i] if i < n else math.inf, next_sync)
            now = min(times)
            run.advance(now)
            busy = i < n or bool(run.queue) or any(
                r.scheduler.has_unfinished_requests() for r in run.replicas if r.stopped_s is None)
            if now > trace.duration_s and not busy:
                break  # the trace is over and every request has finished
            if now > trace.duration_s + overrun_s:
                raise RuntimeError(f"policy {policy.name!r} left requests unserved "
                                   f"{overrun_s:g} s after the trace ended")
            if now == times[0]:
                run.become_ready(heapq.heappop(run.starting)[1], now)
            elif now == times[1]:
                run.route(i, now)
                i += 1
            else:
                desired = policy.decide(run.observe(now), now)
                run.scale(desired, now)
                run.record(now, desired)
                next_sync += policy.sync_period_s
            last = now
    end_s = max(trace.duration_s, last, float(run.finish_s.max()) if n else 0.0)
    timeline = Timeline(*(np.array(column) for column in zip(*run.timeline, strict=True)))
    replicas = tuple(ReplicaRecord(r.index, r.created_s, r.ready_s if r.ready else None,
                                   r.stopped_s, r.served) for r in run.replicas)
    return AutoscaleResult(policy.name, trace, end_s, run.routed_s, run.served_by,
                           run.first_token_s, run.finish_s, replicas, timeline)


def compare_policies(trace: Workload, policies: Sequence[Policy], fleet: FleetConfig | None = None,
                     *, initial_replicas: int = 1) -> list[AutoscaleResult]:
    """Each policy (a fresh instance: policies keep state) on the same trace and fleet, for a
    side-by-side comparison (chapter 5)."""
    if not policies:
        raise ParameterError("policies", "policies must list at least one policy")
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ParameterError("policies", f"policy names must be distinct, got {names}")
    return [simulate_autoscaling(trace, p, fleet, initial_replicas=initial_replicas)
            for p in policies]


def comparison_table(results: Sequence[AutoscaleResult], ttft_slo_ms: float) -> str:
    """Policies side by side (chapter 5): TTFT, SLO attainment, replica-hours, peak replicas,
    and how often the desired count changed."""
    header = (f"{'policy':<22}{'p50 TTFT ms':>12}{'p99 TTFT ms':>12}"
              f"{f'TTFT<={ttft_slo_ms:g}ms':>16}{'replica-h':>11}{'peak':>6}{'changes':>9}")
    rows = [header, "-" * len(header)]
    for s in (r.summary(ttft_slo_ms) for r in results):
        rows.append(f"{s.policy:<22}{s.p50_ttft_ms:>12.0f}{s.p99_ttft_ms:>12.0f}"
                    f"{s.slo_attainment:>16.1%}{s.replica_hours:>11.2f}{s.peak_replicas:>6}"
                    f"{s.scale_changes:>9}")
    return "\n".join(rows)
