"""The production path: Kubernetes manifests that scale vLLM on its queue
(:ref:`ch05-hpa-kpa-keda`).

Two ways to scale a vLLM Deployment on ``vllm:num_requests_waiting``, generated as dicts,
dumped as YAML and validated offline:

- an HPA (``autoscaling/v2``) on a Pods metric, the per-pod gauge that a Prometheus adapter
  serves on ``custom.metrics.k8s.io`` (:func:`prometheus_adapter_rule` is the adapter rule;
  production-stack's adapter config renames the series to ``vllm_num_requests_waiting`` the
  same way, observability/prom-adapter.yaml); validated with ``kubernetes-validate``
  against the Kubernetes 1.37 schema, strict (unknown fields rejected);
- a KEDA ``ScaledObject`` with a prometheus trigger on ``sum(vllm:num_requests_waiting)``
  (the prometheus scaler rejects a query that returns more than one series); KEDA's CRD is
  not in the Kubernetes schema, so :func:`validate_scaled_object` checks it against the
  ``keda.sh/v1alpha1`` CRD schema of KEDA v2.20.2 (config/crd/bases/keda.sh_scaledobjects.yaml,
  stored as data in ``labkit/data/keda_scaledobject_v1alpha1.schema.json``), strict, and the
  prometheus trigger's metadata (pkg/scalers/prometheus_scaler.go).

The ``*_for`` functions take the policy objects of :mod:`labkit.autoscale.hpa` and
:mod:`labkit.autoscale.keda`, so the policy that was simulated is the one deployed. Needs
the ``gateway`` extra (kubernetes-validate, which brings PyYAML and jsonschema).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Mapping

import jsonschema
import kubernetes_validate
import yaml

from labkit.autoscale.hpa import (DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, HPA_TOLERANCE,
                                  HPAScalingRules, HorizontalPodAutoscaler)
from labkit.autoscale.keda import KedaAutoscaler
from labkit.autoscale.observation import WAITING
from labkit.checks import ParameterError, in_range, positive_int
from labkit.data import read_json

KUBERNETES_VERSION = "1.37"
KEDA_VERSION = "2.20.2"


def adapter_metric_name(metric: str) -> str:
    """The name a Prometheus adapter rule serves ``metric`` under: ``:`` becomes ``_``
    (``vllm:num_requests_waiting`` -> ``vllm_num_requests_waiting``, as production-stack's
    rule names it)."""
    return metric.replace(":", "_")


ADAPTER_METRIC = adapter_metric_name(WAITING)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _name(param: str, value: str) -> str:
    """A Kubernetes object name: a DNS-1123 subdomain of at most 253 characters."""
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ParameterError(param, f"{param} must be a DNS-1123 name (lowercase letters, "
                                    f"digits, '-' and '.'), got {value!r}")
    return value


def quantity(value: float) -> str:
    """A Kubernetes quantity string: ``5`` for whole numbers, milli-units (``2500m``) else."""
    in_range("value", value, 0)
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _metadata(name: str, namespace: str | None) -> dict:
    meta = {"name": name}
    if namespace is not None:
        meta["namespace"] = _name("namespace", namespace)
    return meta


# ---------------------------------------------------------------------------------------------
# HPA
# ---------------------------------------------------------------------------------------------

def prometheus_adapter_rule(metric: str = WAITING) -> dict:
    """A prometheus-adapter rule (chapter 5) serving the gauge ``metric`` per pod as a custom metric
    (named by :func:`adapter_metric_name`), what an HPA's Pods metric reads."""
    name = adapter_metric_name(metric)
    return {
        "seriesQuery": f'{{__name__="{metric}",namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                    "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{re.escape(metric)}$", "as": name},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }


def _rules(rules: HPAScalingRules) -> dict:
    out = {"stabilizationWindowSeconds": rules.stabilization_window_s,
           "selectPolicy": rules.select_policy,
           "policies": [{"type": p.type, "value": p.value, "periodSeconds": p.period_s}
                        for p in rules.policies]}
    if rules.tolerance != HPA_TOLERANCE:  # the field is beta (HPAConfigurableTolerance)
        out["tolerance"] = quantity(rules.tolerance)
    return out


def hpa_manifest(deployment: str, *, min_replicas: int = 1, max_replicas: int = 10,
                 target_average_value: float = 5.0, metric: str = ADAPTER_METRIC,
                 scale_up: HPAScalingRules = DEFAULT_SCALE_UP,
                 scale_down: HPAScalingRules = DEFAULT_SCALE_DOWN,
                 namespace: str | None = None, name: str | None = None) -> dict:
    """An ``autoscaling/v2`` HPA (chapter 5) for ``deployment`` on the Pods metric ``metric``
    (average ``target_average_value`` per pod), with its ``behavior`` spelled out (the
    defaults are Kubernetes' own: see ``labkit.autoscale.hpa.DEFAULT_SCALE_UP``)."""
    _name("deployment", deployment)
    positive_int("min_replicas", min_replicas)
    positive_int("max_replicas", max_replicas, at_least=min_replicas)
    in_range("target_average_value", target_average_value, 0, low_open=True)
    manifest = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(_name("name", name or f"{deployment}-hpa"), namespace),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": metric},
                "target": {"type": "AverageValue",
                           "averageValue": quantity(target_average_value)}}}],
            "behavior": {"scaleUp": _rules(scale_up), "scaleDown": _rules(scale_down)},
        },
    }
    validate_hpa(manifest)
    return manifest


def hpa_manifest_for(hpa: HorizontalPodAutoscaler, deployment: str, *,
                     namespace: str | None = None) -> dict:
    """The manifest of a simulated :class:`~labkit.autoscale.HorizontalPodAutoscaler` (a Pods
    metric, served by the adapter under :func:`adapter_metric_name`)."""
    if hpa.metric_type != "Pods":
        raise ParameterError("hpa", "hpa_manifest_for takes a Pods-metric HPA; an External "
                                    "one is what KEDA creates (scaled_object_manifest_for)")
    return hpa_manifest(deployment, min_replicas=hpa.min_replicas,
                        max_replicas=hpa.max_replicas, target_average_value=hpa.target,
                        metric=adapter_metric_name(hpa.metric), scale_up=hpa.scale_up,
                        scale_down=hpa.scale_down, namespace=namespace)


def validate_hpa(manifest: Mapping, kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Check ``manifest`` against the Kubernetes schema (strict: no unknown field) and the
    semantic rules the schema cannot express; raise :class:`~labkit.checks.ParameterError` naming
    the field (``spec.maxReplicas``)."""
    try:
        kubernetes_validate.validate(dict(manifest), kubernetes_version, strict=True)
    except jsonschema.ValidationError as err:
        where = field_at_fault(err)
        raise ParameterError(where, f"{where}: {err.message}") from None
    spec = manifest["spec"]
    # pkg/apis/autoscaling/validation: minReplicas >= 1 (0 only behind HPAScaleToZero),
    # maxReplicas >= minReplicas.
    low = spec.get("minReplicas", 1)
    if low < 1:
        raise ParameterError("spec.minReplicas", f"spec.minReplicas must be >= 1, got {low}")
    if spec["maxReplicas"] < low:
        raise ParameterError("spec.maxReplicas", f"spec.maxReplicas must be >= minReplicas "
                                                 f"({low}), got {spec['maxReplicas']}")


# ---------------------------------------------------------------------------------------------
# KEDA
# ---------------------------------------------------------------------------------------------

def scaled_object_manifest(deployment: str, *, server_address: str, threshold: float = 5.0,
                           activation_threshold: float = 0.0, min_replica_count: int = 0,
                           max_replica_count: int = 10, polling_interval_s: int = 30,
                           cooldown_period_s: int = 300, metric: str = WAITING,
                           query: str | None = None, namespace: str | None = None,
                           name: str | None = None) -> dict:
    """A KEDA ``ScaledObject`` (chapter 5) for ``deployment`` with a prometheus trigger.

    ``query`` defaults to the fleet's ``sum(metric)`` (``vllm:num_requests_waiting``) over the
    Deployment's pods in ``namespace``; ``threshold`` is the value one replica should carry
    (KEDA's AverageValue), ``activation_threshold`` the value above which KEDA wakes the
    Deployment from 0.
    """
    _name("deployment", deployment)
    if not isinstance(server_address, str) or not re.match(r"^https?://", server_address):
        raise ParameterError("server_address", f"server_address must be an http(s) URL of "
                                               f"Prometheus, got {server_address!r}")
    if query is None:
        selector = f'namespace="{namespace}",' if namespace else ""
        query = f'sum({metric}{{{selector}pod=~"{deployment}-.*"}})'
    manifest = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(_name("name", name or f"{deployment}-scaler"), namespace),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": deployment},
            "pollingInterval": polling_interval_s,
            "cooldownPeriod": cooldown_period_s,
            "minReplicaCount": min_replica_count,
            "maxReplicaCount": max_replica_count,
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": server_address, "query": query,
                "threshold": f"{threshold:g}",
                "activationThreshold": f"{activation_threshold:g}"}}],
        },
    }
    validate_scaled_object(manifest)
    return manifest


def scaled_object_manifest_for(keda: KedaAutoscaler, deployment: str, *, server_address: str,
                               namespace: str | None = None) -> dict:
    """The manifest of a simulated :class:`~labkit.autoscale.KedaAutoscaler`."""
    for param, value in (("polling_interval_s", keda.polling_interval_s),
                         ("cooldown_period_s", keda.cooldown_period_s)):
        if value != int(value):
            raise ParameterError(param, f"{param} must be whole seconds in a manifest, "
                                        f"got {value}")
    return scaled_object_manifest(
        deployment, server_address=server_address, threshold=keda.hpa.target,
        activation_threshold=keda.activation_threshold,
        min_replica_count=keda.min_replica_count, max_replica_count=keda.hpa.max_replicas,
        polling_interval_s=int(keda.polling_interval_s),
        cooldown_period_s=int(keda.cooldown_period_s), metric=keda.metric, namespace=namespace)


#: The envelope of a ScaledObject (the CRD's schema types ``apiVersion`` and ``kind`` as any
#: string; the API server routes on them) and the prometheus trigger's required metadata and
#: number fields, from its scaler (pkg/scalers/prometheus_scaler.go: serverAddress, query,
#: threshold; threshold and activationThreshold parse as floats).
_SCALED_OBJECT_RULES = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"properties": {"triggers": {"items": {
            "if": {"properties": {"type": {"const": "prometheus"}}, "required": ["type"]},
            "then": {"properties": {"metadata": {
                "required": ["serverAddress", "query", "threshold"],
                "properties": {"threshold": {"$ref": "#/$defs/number"},
                               "activationThreshold": {"$ref": "#/$defs/number"}}}}}}}}},
    },
    "$defs": {"number": {"type": "string",
                         "pattern": r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$"}},
}


def strict(schema: Mapping) -> dict:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    properties and says nothing about others: what the Kubernetes API server does to a
    custom resource under strict field validation, and what catches a misspelled Helm value
    (Helm ignores keys its templates never read). Objects marked
    ``x-kubernetes-preserve-unknown-fields`` keep their freedom (chapters 5 and 8)."""
    schema = copy.deepcopy(dict(schema))

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def _scaled_object_schema() -> dict:
    """KEDA's CRD schema, stored in labkit/data with its source, strict (:func:`strict`)."""
    return strict(read_json("keda_scaledobject_v1alpha1.schema.json"))


def validate_scaled_object(manifest: Mapping) -> None:
    """Check a ScaledObject against the ``keda.sh/v1alpha1`` CRD schema of KEDA v2.20.2
    (config/crd/bases/keda.sh_scaledobjects.yaml, stored in labkit/data), strict, then the
    prometheus trigger's metadata and the CRD's rule ``minReplicaCount <= maxReplicaCount``
    (its ``x-kubernetes-validations``); raise :class:`~labkit.checks.ParameterError` naming
    the field (``spec.pollingInterval``)."""
    for schema in (_SCALED_OBJECT_RULES, _scaled_object_schema()):
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema).iter_errors(manifest))
        if error is not None:
            where = field_at_fault(error)
            raise ParameterError(where, f"{where}: {error.message}")
    spec = manifest["spec"]
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if high < low:
        raise ParameterError("spec.maxReplicaCount", f"spec.maxReplicaCount must be >= "
                                                     f"minReplicaCount ({low}), got {high}")


def field_at_fault(error: jsonschema.ValidationError) -> str:
    """The dotted path of the field at fault: for a missing or unexpected property, the
    property itself, not the object that holds it."""
    path = [str(p) for p in error.absolute_path]
    instance = error.instance if isinstance(error.instance, Mapping) else {}
    if error.validator == "required":
        path.append(next(k for k in error.validator_value if k not in instance))
    elif error.validator == "additionalProperties" and isinstance(error.schema, Mapping):
        known = error.schema.get("properties", {})
        path.append(next(k for k in instance if k not in known))
    return ".".join(path) or "manifest"


def to_yaml(*manifests: Mapping) -> str:
    """Manifests as one multi-document YAML stream, fields in the order written."""
    return yaml.safe_dump_all([dict(m) for m in manifests], sort_keys=False)
