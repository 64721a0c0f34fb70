"""A real autoscaler: ``labkit serve`` processes behind a gateway, scaled on their metrics
(:ref:`ch05-hpa-kpa-keda`).

On Kubernetes, three controllers share the work that :class:`ProcessAutoscaler` does on one
machine:

- the **HPA** (or KEDA, whose ScaledObject creates one) reads the replicas' metrics every
  sync period and writes a new ``spec.replicas``; it never starts or stops a pod itself;
- the **ReplicaSet** controller makes the pods match ``spec.replicas``: it creates pods, and
  on scale-down picks which ones to delete; it also replaces pods that fail, which the HPA
  only notices as fewer ready pods;
- the **kubelet** starts the containers and probes readiness; only ready pods receive
  traffic (the Service's endpoints), and a deleted pod is taken out of them, then sent
  SIGTERM, then SIGKILL after ``terminationGracePeriodSeconds``.

Here: each sync the controller probes every ready replica's ``/health`` and scrapes its
``/metrics`` (vLLM's names, read with :func:`labkit.gateway.backends.parse_backend_metrics`),
builds the :class:`~labkit.autoscale.observation.Observation` every policy of
:mod:`labkit.autoscale` expects, asks ``policy.decide(observation, now)`` for the
desired replica count, and reconciles. Scale-up starts a process, waits for its ``/health``
and ``POST /add_worker``\\s it to the gateway; scale-down ``POST /remove_worker``\\s it (the gateway
drains it: no new requests, and it waits for the open ones), then SIGTERMs the process and
waits for it. The gateway is reached only over HTTP (vllm-router's admin API, which
``labkit gateway`` mirrors), so it may run in another process.

Pending replicas are counted as pods that are not ready and export no metrics: the HPA
treats those as using nothing on a scale-up, so a replica still loading does not make it
start a second copy of the same scale-up, and the reconciler compares the desired count with
the replicas that exist, starting or ready, never with the ready ones only. Replicas being
removed are no longer counted, as the HPA ignores pods with a deletion timestamp
(kubernetes/kubernetes PR #95560, ``groupPods`` in
``pkg/controller/podautoscaler/replica_calculator.go``, merged 2020).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import httpx

from labkit.autoscale.knative import KnativePodAutoscaler
from labkit.autoscale.observation import (
    CONCURRENCY,
    KV_CACHE_USAGE,
    RUNNING,
    WAITING,
    Observation,
    PodMetrics,
    Policy,
)
from labkit.checks import ParameterError, in_range, positive_int
from labkit.gateway.backends import parse_backend_metrics
from labkit.gateway.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_WORKER_STARTUP_TIMEOUT_S,
)
from labkit.http.urls import normalize_url
from labkit.launch import ServeConfig, labkit_command
from labkit.process import ServerProcess, free_port, signal_group, wait_until

# A replica's phase, in the words of ``kubectl get pods``.
STARTING = "starting"        # process started, not yet healthy and added to the gateway
READY = "ready"              # in the gateway's pool, receiving requests
TERMINATING = "terminating"  # chosen for scale-down: draining, then stopping
FAILED = "failed"            # died, or never got ready
STOPPED = "stopped"          # its process has exited and been waited for

#: A replica whose ``/health`` fails this many syncs in a row is killed, then replaced: a
#: liveness probe gives up after ``failureThreshold`` consecutive failures, 3 by default
#: (Kubernetes API reference, core/v1 ``Probe``).
LIVENESS_FAILURE_THRESHOLD = 3

#: Crash-loop backoff after replicas that fail to start: the kubelet restarts a failing
#: container "with an exponential back-off delay (10s, 20s, 40s, ...), that is capped at
#: five minutes" (kubernetes.io, "Pod Lifecycle", container restart policy, 2025).
BACKOFF_INITIAL_S, BACKOFF_MAX_S = 10.0, 300.0

#: The pod metrics an observation carries: vLLM's name of each, by the key that
#: :func:`parse_backend_metrics` gives it.
_POD_METRICS = {"num_requests_waiting": WAITING, "num_requests_running": RUNNING,
                "kv_cache_usage": KV_CACHE_USAGE}


@dataclass(frozen=True)
class SyncRecord:
    """One sync of the control loop, for plots (chapter 5): at ``time_s`` (the injected
    clock) the policy saw ``ready`` replicas serving and ``starting`` ones loading, with
    ``metric_total`` the sum of its metric over the ready ones (``waiting`` and ``running``
    are the sums of ``vllm:num_requests_waiting`` and ``vllm:num_requests_running``, whatever
    the policy reads); it asked for ``decided`` replicas, and ``desired`` is what the
    controller set (``decided`` within ``[1, max_replicas]``)."""

    time_s: float
    decided: int
    desired: int
    ready: int
    starting: int
    metric_total: float
    waiting: float
    running: float


@dataclass(frozen=True)
class ReplicaEvent:
    """Something that happened to one replica (chapter 5). ``kind`` is ``starting``,
    ``ready`` (healthy and added to the gateway), ``scale-down`` (chosen for removal),
    ``close`` (removed because the autoscaler closes), ``unhealthy`` (failed its liveness
    probes, killed), ``died`` (exited while ready),
    ``removed`` (the gateway's answer to ``/remove_worker``, after draining, in
    ``detail``; ``remove failed`` when it did not answer 200), ``failed`` (never got ready)
    or ``stopped`` (exited and waited for; the exit status in ``detail``)."""

    time_s: float
    replica: str
    url: str
    pid: int | None
    kind: str
    detail: str = ""


@dataclass(frozen=True)
class ReplicaStatus:
    """A replica as ``kubectl get pods`` would list it: name, URL, process id, phase."""

    name: str
    url: str
    pid: int | None
    phase: str


@dataclass(eq=False)
class _Replica:
    name: str
    url: str
    server: ServerProcess
    created: int                   # creation order
    phase: str = STARTING
    ready_order: int | None = None  # the order in which replicas became ready
    probe_failures: int = 0        # /health failures in a row
    adding: bool = False           # /add_worker sent: too late to kill it mid-start
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        process = self.server.process
        return None if process is None else process.pid


def _deletion_rank(replica: _Replica) -> tuple:
    """Sort key, smallest first, of the replicas to remove on scale-down (chapter 5).

    The ReplicaSet controller sorts the pods it may delete (``ActivePodsWithRanks`` in
    kubernetes/kubernetes ``pkg/controller/controller_utils.go``; documented under
    "Scaling a ReplicaSet" on kubernetes.io): unscheduled before scheduled, Pending before
    Unknown before Running, not ready before ready, lower ``pod-deletion-cost`` first,
    pods on crowded nodes first, then ready for a shorter time before longer, more
    container restarts first, and created more recently before older. On one machine, with
    no costs and no restarts counted, that leaves: replicas still starting first, then the
    one that became ready last, then the newest. Kubernetes compares the times on a log2
    scale with random tie-breaks (``LogarithmicScaleDown``, beta since v1.22) to spread
    deletions; we keep the exact order, so a lab can predict which replica goes.
    """
    ready = replica.ready_order is not None
    return (ready, -(replica.ready_order or 0), -replica.created)


def exit_status(returncode: int) -> str:
    """A process's end in words: ``exit status 1``, or the signal that ended it. A replica
    stopped gracefully ends by ``SIGTERM``: uvicorn shuts down, then raises the signal it
    caught again so the parent sees why it stopped."""
    if returncode < 0:
        return f"ended by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def crash_backoff_s(failures: int) -> float:
    """Seconds to wait before starting a replica again after ``failures`` consecutive
    failed starts (the kubelet's CrashLoopBackOff: 10 s, doubling, at most 300 s)."""
    positive_int("failures", failures, at_least=0)
    return 0.0 if failures == 0 else min(BACKOFF_INITIAL_S * 2 ** (failures - 1),
                                         BACKOFF_MAX_S)


class ProcessAutoscaler:
    """The HPA/KEDA loop on one machine: real ``labkit serve`` replicas behind a gateway
    (chapter 5).

    ``gateway_url`` is a running gateway with vllm-router's admin API (``labkit gateway``,
    or :class:`labkit.gateway.Gateway` served anywhere); ``api_key`` is its key, if it has
    one. ``policy`` is a :class:`~labkit.autoscale.observation.Policy` (HPA, KPA, KEDA,
    threshold); the loop runs every ``policy.sync_period_s`` seconds. Each replica is
    ``labkit serve`` with ``serve``'s options (model directory, served name,
    ``max_num_seqs``, ...) on a port of its own.

    - ``initial_replicas`` start with :meth:`start`, which waits until they are ready;
    - ``max_replicas`` is the machine's capacity: a larger count from the policy is cut to
      it (on a cluster, pods beyond capacity would stay Pending). A policy asking for 0 gets
      1: nothing in front of this gateway holds requests while no replica runs (Knative's
      activator, KEDA's HTTP add-on do), so scale to zero would answer 503s;
    - ``drain_timeout_s`` (default 30 s, Kubernetes' ``terminationGracePeriodSeconds``)
      is how long the gateway waits for a leaving replica's open requests;
    - ``startup_timeout_s`` (default 600 s, vllm-router's ``worker_startup_timeout_secs``)
      is how long a replica may take to get healthy; ``probe_timeout_s`` bounds each
      ``/health`` probe and ``/metrics`` read (default 5 s, vllm-router's health-check
      timeout);
    - ``metric`` names what ``history`` records (default: the policy's own metric);
    - ``clock`` (seconds, default ``time.monotonic``) stamps events and backoffs; decisions
      take ``now`` from :meth:`step`, which defaults to ``clock()``.

    The pod metrics each observation carries, per ready replica: ``vllm:num_requests_waiting``,
    ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` as scraped, and Knative's
    ``concurrency``, requests in flight in the replica (waiting + running). Requests held in
    front of the fleet (``queued``) are 0: the gateway forwards at once. GPU utilization and
    latency are not scraped (the teaching engine has no GPU), so a threshold policy here acts
    on the queue alone.

    A replica that dies is noticed at the next sync: it is taken out of the gateway and,
    since there are then fewer replicas than desired, a new one is started, as the
    ReplicaSet replaces a failed pod (the HPA itself only sees fewer ready pods). One whose
    process lives but whose ``/health`` fails :data:`LIVENESS_FAILURE_THRESHOLD` syncs in a
    row (``labkit serve`` answers 503 once its engine loop died; a hung one does not answer)
    is killed, as the kubelet kills a container that fails its liveness probe, and then
    replaced the same way. It gets SIGKILL at once where the kubelet would send SIGTERM
    first: a server that no longer answers is unlikely to shut down gracefully, and the
    gateway's own probes have stopped routing to it. A replica that fails to start is
    replaced too, after a crash-loop backoff (:func:`crash_backoff_s`, reset once a replica
    gets ready), so a broken model directory does not start a process every second.

    Use it as a context manager (``with ProcessAutoscaler(...) as scaler:`` starts the
    replicas and the loop; leaving removes and stops every replica, on Ctrl-C too, and on
    SIGTERM inside :func:`labkit.process.exit_on_sigterm`; a process killed outright takes its
    replicas with it, through the parent-death signal), or start it with
    ``run_loop=False`` (``with ProcessAutoscaler(...).start(run_loop=False) as scaler:``)
    and drive :meth:`step` yourself, with whatever ``now`` you like.
    """

    def __init__(self, gateway_url: str, policy: Policy, serve: ServeConfig, *,
                 initial_replicas: int = 1, max_replicas: int = 4,
                 drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 startup_timeout_s: float = DEFAULT_WORKER_STARTUP_TIMEOUT_S,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 api_key: str | None = None, metric: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        try:
            self.gateway_url = normalize_url(gateway_url)
        except ParameterError as err:
            raise ParameterError("gateway_url", f"gateway_url must be http://host:port, got "
                                                f"{gateway_url!r}") from err
        if not callable(getattr(policy, "decide", None)):
            raise ParameterError("policy", f"policy must have decide(observation, now), got "
                                           f"{policy!r}")
        in_range("policy.sync_period_s", getattr(policy, "sync_period_s", None), 0,
                 low_open=True)
        if not isinstance(serve, ServeConfig):
            raise ParameterError("serve", f"serve must be a ServeConfig, got {serve!r}")
        try:
            labkit_command(serve)
        except ValueError as err:
            raise ParameterError("serve", f"serve: {err}") from err
        self.policy, self.serve = policy, serve
        self.initial_replicas = positive_int("initial_replicas", initial_replicas)
        self.max_replicas = positive_int("max_replicas", max_replicas, at_least=initial_replicas)
        self.drain_timeout_s = in_range("drain_timeout_s", drain_timeout_s, 0)
        self.startup_timeout_s = in_range("startup_timeout_s", startup_timeout_s, 0,
                                          low_open=True)
        self.probe_timeout_s = in_range("probe_timeout_s", probe_timeout_s, 0,
                                         low_open=True)
        self.metric = metric or getattr(policy, "metric", None) or (
            CONCURRENCY if isinstance(policy, KnativePodAutoscaler) else WAITING)
        self.clock = clock
        self.desired = initial_replicas  # the Deployment's spec.replicas
        self.history: list[SyncRecord] = []
        self.events: list[ReplicaEvent] = []
        self.error: BaseException | None = None  # what stopped the background loop, if any
        self._replicas: list[_Replica] = []
        self._created = self._became_ready = 0
        self._failed_starts = 0
        self._next_start_s = -float("inf")  # the crash-loop backoff, on ``clock``
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._loop: threading.Thread | None = None
        self._started = False
        # Admin calls wait for the gateway's drain; trust_env=False keeps an HTTP_PROXY
        # from capturing loopback traffic.
        self._http = httpx.Client(timeout=httpx.Timeout(self.drain_timeout_s + 30, connect=5),
                                  headers={"Authorization": f"Bearer {api_key}"} if api_key
                                  else {}, trust_env=False)
        self._scrapers = ThreadPoolExecutor(max_workers=max_replicas,
                                            thread_name_prefix="autoscaler-scrape")

    # -- the public face --------------------------------------------------------------------

    def start(self, run_loop: bool = True) -> ProcessAutoscaler:
        """Start ``initial_replicas`` replicas and wait until they are ready (or raise
        ``RuntimeError``, leaving nothing running); then, with ``run_loop``, run
        :meth:`step` every ``policy.sync_period_s`` seconds in a background thread."""
        if self._started:
            raise RuntimeError("this autoscaler was already started")
        self._started = True
        with self._lock:
            first = [self._launch() for _ in range(self.initial_replicas)]
        with contextlib.suppress(TimeoutError):  # what did not start is reported below
            wait_until(lambda: all(r.phase != STARTING for r in first),
                       self.startup_timeout_s + 30, 0.05, what="the initial replicas started")
        if any(r.phase != READY for r in first):
            detail = next((e.detail for e in self.events if e.kind == "failed"),
                          "not ready in time")
            self.close()
            raise RuntimeError(f"the initial replicas did not start: {detail}")
        if run_loop:
            self._loop = threading.Thread(target=self._run, name="autoscaler-loop",
                                          daemon=True)
            self._loop.start()
        return self

    def step(self, now: float | None = None) -> int:
        """One sync: notice dead replicas, scrape the ready ones, ask the policy, and start
        or remove replicas to match; returns the desired count. ``now`` (seconds) is the
        policy's clock, ``clock()`` by default."""
        now = self.clock() if now is None else now
        with self._lock:
            self._notice_deaths()
            ready = [r for r in self._replicas if r.phase == READY]
            starting = [r for r in self._replicas if r.phase == STARTING]
        scraped = list(self._scrapers.map(self._observe, ready))
        pods = tuple(PodMetrics(r.name, True, m) for r, m in zip(ready, scraped, strict=True))
        pods += tuple(PodMetrics(r.name, False) for r in starting)
        observation = Observation(self.desired, pods)
        decided = self.policy.decide(observation, now)
        with self._lock:
            self.desired = min(max(decided, 1), self.max_replicas)
            self._reconcile()
            self.history.append(SyncRecord(
                now, decided, self.desired, len(ready), len(starting),
                observation.total(self.metric), observation.total(WAITING),
                observation.total(RUNNING)))
        return self.desired

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica started so far and its phase, oldest first."""
        with self._lock:
            return [ReplicaStatus(r.name, r.url, r.pid, r.phase) for r in self._replicas]

    @property
    def ready_count(self) -> int:
        """Replicas in the gateway's pool now."""
        with self._lock:
            return sum(r.phase == READY for r in self._replicas)

    def close(self) -> None:
        """Stop the loop, then remove every replica from the gateway (draining it) and stop
        its process; returns once every process has exited. Safe to call twice."""
        self._closing.set()
        if self._loop is not None:
            self._loop.join()
        with self._lock:
            for replica in self._replicas:
                if replica.phase in (STARTING, READY):
                    self._terminate(replica, "close")
            threads = [r.thread for r in self._replicas if r.thread is not None]
        for thread in threads:
            thread.join()
        self._scrapers.shutdown()
        self._http.close()

    def __enter__(self) -> ProcessAutoscaler:
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        period_s = self.policy.sync_period_s
        while not self._closing.is_set():
            began = time.monotonic()
            try:
                self.step()
            except BaseException as err:  # kept for the caller, and printed by the thread
                self.error = err
                raise
            self._closing.wait(max(0.0, period_s - (time.monotonic() - began)))

    def _observe(self, replica: _Replica) -> dict[str, float]:
        """Probe the replica's ``/health``, then read its pod metrics; empty when either
        fails (the HPA then counts the pod as missing its metric)."""
        return self._scrape(replica) if self._alive(replica) else {}

    def _alive(self, replica: _Replica) -> bool:
        """One liveness probe; the one that makes :data:`LIVENESS_FAILURE_THRESHOLD`
        failures in a row kills the process (the next sync sees it gone)."""
        try:
            response = self._http.get(replica.url + "/health", timeout=self.probe_timeout_s)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        replica.probe_failures = 0 if healthy else replica.probe_failures + 1
        if replica.probe_failures == LIVENESS_FAILURE_THRESHOLD:
            self._record(replica, "unhealthy", f"{LIVENESS_FAILURE_THRESHOLD} failed /health "
                                               "probes in a row: killed")
            signal_group(replica.server.process.pid, signal.SIGKILL)
        return healthy

    def _scrape(self, replica: _Replica) -> dict[str, float]:
        try:
            response = self._http.get(replica.url + "/metrics", timeout=self.probe_timeout_s)
            response.raise_for_status()
            values = parse_backend_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            return {}
        metrics = {name: values[key] for key, name in _POD_METRICS.items() if key in values}
        if WAITING in metrics and RUNNING in metrics:
            metrics[CONCURRENCY] = metrics[WAITING] + metrics[RUNNING]
        return metrics

    # -- the ReplicaSet's part (called with the lock held) ----------------------------------

    def _reconcile(self) -> None:
        live = [r for r in self._replicas if r.phase in (STARTING, READY)]
        if len(live) < self.desired and self.clock() >= self._next_start_s:
            for _ in range(self.desired - len(live)):
                self._launch()
        for replica in sorted(live, key=_deletion_rank)[:max(0, len(live) - self.desired)]:
            self._terminate(replica, "scale-down")

    def _launch(self) -> _Replica:
        cfg = replace(self.serve, port=free_port())
        # Started from its replica's thread, which lives as long as the replica: the replica
        # still gets the parent-death signal (PR_SET_PDEATHSIG fires when the *thread* that
        # forked it exits), so a SIGKILLed autoscaler leaves no replica behind.
        server = ServerProcess(labkit_command(cfg), cfg.base_url,
                               startup_timeout_s=self.startup_timeout_s,
                               thread_outlives_server=True)
        replica = _Replica(f"replica-{self._created}", cfg.base_url, server, self._created)
        self._created += 1
        self._replicas.append(replica)
        self._record(replica, "starting")
        replica.thread = threading.Thread(target=self._lifecycle, args=(replica,),
                                          name=f"autoscaler-{replica.name}", daemon=True)
        replica.thread.start()
        return replica

    def _terminate(self, replica: _Replica, kind: str) -> None:
        """Take ``replica`` out of the count and have its thread remove and stop it. One
        still starting is killed at once, as a Pending pod is deleted right away."""
        replica.phase = TERMINATING
        self._record(replica, kind)
        replica.stop.set()
        process = replica.server.process
        if not replica.adding and process is not None and process.poll() is None:
            signal_group(process.pid, signal.SIGTERM)

    def _notice_deaths(self) -> None:
        for replica in self._replicas:
            process = replica.server.process
            if replica.phase == READY and process.poll() is not None:
                replica.phase = FAILED
                self._record(replica, "died", exit_status(process.returncode))
                replica.stop.set()  # its thread takes it out of the gateway

    def _record(self, replica: _Replica, kind: str, detail: str = "") -> None:
        with self._lock:
            self.events.append(ReplicaEvent(self.clock(), replica.name, replica.url,
                                            replica.pid, kind, detail))

    # -- one replica's life, in its own thread ----------------------------------------------

    def _lifecycle(self, replica: _Replica) -> None:
        try:
            replica.server.start()
        except (RuntimeError, TimeoutError) as err:
            if not replica.stop.is_set():
                self._start_failed(replica, f"did not get healthy: {err}")
                return
        with self._lock:
            replica.adding = not replica.stop.is_set()
        if replica.adding:
            added, answer = self._admin("/add_worker", url=replica.url)
            if not added:
                self._start_failed(replica, f"the gateway did not add it: {answer}")
                return
            with self._lock:
                if replica.phase == STARTING:
                    replica.phase = READY
                replica.ready_order = self._became_ready
                self._became_ready += 1
                self._failed_starts = 0
                self._next_start_s = -float("inf")
                self._record(replica, "ready")
            replica.stop.wait()
            # A dead replica has nothing left to drain; a live one gets the full timeout.
            drain_s = 0 if replica.phase == FAILED else self.drain_timeout_s
            removed, answer = self._admin("/remove_worker", url=replica.url,
                                          drain_timeout_s=drain_s)
            self._record(replica, "removed" if removed else "remove failed", answer)
        self._stop(replica)

    def _start_failed(self, replica: _Replica, detail: str) -> None:
        with self._lock:
            replica.phase = FAILED
            self._failed_starts += 1
            self._next_start_s = self.clock() + crash_backoff_s(self._failed_starts)
            self._record(replica, "failed", f"{detail}\n{replica.server.log_tail()}")
        self._stop(replica)

    def _stop(self, replica: _Replica) -> None:
        replica.server.stop()
        process = replica.server.process
        with self._lock:
            replica.phase = STOPPED
            self._record(replica, "stopped", "never started" if process is None
                         else exit_status(process.returncode))

    def _admin(self, path: str, **params) -> tuple[bool, str]:
        """``POST`` one admin route of the gateway: (answered 200, the answer's text)."""
        try:
            response = self._http.post(self.gateway_url + path, params=params)
        except httpx.HTTPError as err:
            return False, f"{type(err).__name__}: {err}"
        return response.status_code == 200, response.text
