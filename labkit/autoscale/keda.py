"""A KEDA ScaledObject on an injected clock (:ref:`ch05-hpa-kpa-keda`): activation decides 0 <-> 1,
the HPA it creates decides 1..N."""

from __future__ import annotations


from labkit.autoscale.hpa import (DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, HorizontalPodAutoscaler,
                                   HPAScalingRules)
from labkit.autoscale.observation import WAITING, Observation
from labkit.checks import in_range, positive_int

class KedaAutoscaler:
    """A KEDA ScaledObject with one prometheus trigger (chapter 5).

    Two loops, as in KEDA (kedacore/keda v2.20.2, pkg/scaling/executor/
    scale_scaledobjects.go, ``RequestScale``): every ``polling_interval_s`` (default 30)
    KEDA queries the metric; the trigger is active when the value is above
    ``activation_threshold`` (pkg/scalers/prometheus_scaler.go: ``val >
    activationThreshold``, default 0). Active at 0 replicas: scale to ``min_replica_count``
    or 1. Inactive with replicas and ``min_replica_count`` 0: scale to 0 once
    ``cooldown_period_s`` (default 300) has passed since the trigger was last active. Between
    1 and N the HPA KEDA creates decides, on an External metric with an AverageValue target of
    ``threshold`` (KEDA's default metric type; HPA minReplicas = max(min_replica_count, 1),
    maxReplicas = ``max_replica_count``, default 100).

    The value is the fleet's ``sum(vllm:num_requests_waiting)`` plus the requests held in
    front of it: with no replica there is no engine to report waiting requests, which is why
    production-stack's scale-to-zero recipe adds a trigger on its router's
    ``vllm:num_incoming_requests_total`` (docs "Autoscaling with KEDA").
    """

    def __init__(self, threshold: float = 5.0, *, activation_threshold: float = 0.0,
                 min_replica_count: int = 0, max_replica_count: int = 100,
                 polling_interval_s: float = 30.0, cooldown_period_s: float = 300.0,
                 initial_cooldown_period_s: float = 0.0, metric: str = WAITING,
                 scale_up: HPAScalingRules = DEFAULT_SCALE_UP,
                 scale_down: HPAScalingRules = DEFAULT_SCALE_DOWN,
                 hpa_sync_period_s: float = 15.0, name: str = "KEDA") -> None:
        in_range("activation_threshold", activation_threshold, 0)
        positive_int("min_replica_count", min_replica_count, at_least=0)
        positive_int("max_replica_count", max_replica_count, at_least=max(min_replica_count, 1))
        self.polling_interval_s = in_range("polling_interval_s", polling_interval_s, 0,
                                           low_open=True)
        self.cooldown_period_s = in_range("cooldown_period_s", cooldown_period_s, 0)
        self.initial_cooldown_period_s = in_range("initial_cooldown_period_s",
                                                  initial_cooldown_period_s, 0)
        self.activation_threshold = activation_threshold
        self.min_replica_count = min_replica_count
        self.metric = metric
        self.hpa = HorizontalPodAutoscaler(
            metric, threshold, min_replicas=max(min_replica_count, 1),
            max_replicas=max_replica_count, metric_type="External", scale_up=scale_up,
            scale_down=scale_down, sync_period_s=hpa_sync_period_s, name=f"{name}'s HPA")
        self.sync_period_s = min(hpa_sync_period_s, polling_interval_s)
        self.name = name
        self.created_s: float | None = None
        self.last_poll_s: float | None = None
        self.last_active_s: float | None = None
        self.next_hpa_s: float | None = None

    def value(self, observation: Observation) -> float:
        """The trigger's query result: waiting requests in the fleet and in front of it."""
        return observation.total(self.metric) + (observation.queued
                                                 if self.metric == WAITING else 0)

    def decide(self, observation: Observation, now: float) -> int:
        """KEDA's poll when one is due (it may scale 0 <-> N on its own), else the HPA's sync
        when due; between both, nothing changes."""
        if self.created_s is None:
            self.created_s = now
        current = observation.replicas
        if self.last_poll_s is None or now - self.last_poll_s >= self.polling_interval_s:
            self.last_poll_s = now
            scaled = self._poll(current, self.value(observation) > self.activation_threshold,
                                now)
            if scaled != current:
                return scaled
        if self.next_hpa_s is None or now >= self.next_hpa_s:
            self.next_hpa_s = now + self.hpa.sync_period_s
            return self.hpa.decide(observation, now)
        return current

    def _poll(self, current: int, active: bool, now: float) -> int:
        if active:
            self.last_active_s = now
            return max(self.min_replica_count, 1) if current == 0 else current
        if current > 0 and self.min_replica_count == 0:
            quiet_since, wait = ((self.created_s, self.initial_cooldown_period_s)
                                 if self.last_active_s is None
                                 else (self.last_active_s, self.cooldown_period_s))
            return 0 if quiet_since + wait < now else current
        return max(current, self.min_replica_count)
