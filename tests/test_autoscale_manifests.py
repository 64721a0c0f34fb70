"""Generated HPA and KEDA manifests: valid against their schemas, invalid ones refused by
field (chapter 5)."""

import copy

import kubernetes_validate
import pytest
import yaml

from labkit.autoscale import (RUNNING, HorizontalPodAutoscaler, HPAScalingPolicy,
                              HPAScalingRules, KedaAutoscaler)
from labkit.autoscale.manifests import (hpa_manifest, hpa_manifest_for, prometheus_adapter_rule,
                                        quantity, scaled_object_manifest,
                                        scaled_object_manifest_for, to_yaml, validate_hpa,
                                        validate_scaled_object)
from labkit.checks import ParameterError

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


def test_hpa_manifest_is_valid_kubernetes_1_37():
    manifest = hpa_manifest("vllm-llama3", max_replicas=8, namespace="serving")
    kubernetes_validate.validate(manifest, "1.37", strict=True)  # raises if not
    spec = manifest["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": "vllm-llama3"}
    (metric,) = spec["metrics"]
    assert metric == {"type": "Pods", "pods": {
        "metric": {"name": "vllm_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "5"}}}
    # Kubernetes' own defaults, spelled out.
    assert spec["behavior"]["scaleUp"] == {
        "stabilizationWindowSeconds": 0, "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15},
                     {"type": "Percent", "value": 100, "periodSeconds": 15}]}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_manifest_from_the_simulated_policy():
    slow_down = HPAScalingRules(600, (HPAScalingPolicy("Pods", 1, 60),), tolerance=0.05)
    hpa = HorizontalPodAutoscaler(RUNNING, 12.5, min_replicas=2, max_replicas=6,
                                  scale_down=slow_down)
    spec = hpa_manifest_for(hpa, "vllm")["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert spec["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_running"
    assert spec["metrics"][0]["pods"]["target"]["averageValue"] == "12500m"
    assert spec["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 600, "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}], "tolerance": "50m"}
    with pytest.raises(ParameterError):
        hpa_manifest_for(HorizontalPodAutoscaler(metric_type="External"), "vllm")


def test_yaml_round_trip_and_adapter_rule():
    documents = list(yaml.safe_load_all(to_yaml(hpa_manifest("vllm"),
                                                 scaled_object_manifest(
                                                     "vllm", server_address=PROMETHEUS))))
    assert [d["kind"] for d in documents] == ["HorizontalPodAutoscaler", "ScaledObject"]
    assert documents[0] == hpa_manifest("vllm")
    rule = prometheus_adapter_rule()
    assert rule["name"]["as"] == "vllm_num_requests_waiting"
    assert rule["seriesQuery"] == '{__name__="vllm:num_requests_waiting",namespace!="",pod!=""}'


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m["spec"].__setitem__("maxReplicas", "8"), "spec.maxReplicas"),
    (lambda m: m["spec"]["scaleTargetRef"].pop("name"), "spec.scaleTargetRef.name"),
    (lambda m: m["spec"]["behavior"]["scaleUp"].__setitem__("window", 1),
     "spec.behavior.scaleUp.window"),
    (lambda m: m["spec"].__setitem__("maxReplicas", 0), "spec.maxReplicas"),
    (lambda m: m["spec"].__setitem__("minReplicas", 0), "spec.minReplicas"),
])
def test_invalid_hpa_is_rejected_naming_the_field(mutate, field):
    manifest = copy.deepcopy(hpa_manifest("vllm"))
    mutate(manifest)
    with pytest.raises(ParameterError) as err:
        validate_hpa(manifest)
    assert err.value.param == field


def test_hpa_arguments_are_checked():
    with pytest.raises(ParameterError) as err:
        hpa_manifest("vllm", min_replicas=4, max_replicas=2)
    assert err.value.param == "max_replicas"
    with pytest.raises(ParameterError) as err:
        hpa_manifest("Vllm_Llama")
    assert err.value.param == "deployment"


def test_scaled_object_manifest():
    manifest = scaled_object_manifest("vllm-llama3", server_address=PROMETHEUS,
                                      namespace="serving", activation_threshold=2)
    spec = manifest["spec"]
    assert (spec["minReplicaCount"], spec["pollingInterval"], spec["cooldownPeriod"]) == \
        (0, 30, 300)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(vllm:num_requests_waiting{namespace="serving",pod=~"vllm-llama3-.*"})',
        "threshold": "5", "activationThreshold": "2"}
    keda = KedaAutoscaler(4, activation_threshold=1, min_replica_count=1, max_replica_count=6,
                          polling_interval_s=15, cooldown_period_s=360)
    spec = scaled_object_manifest_for(keda, "vllm", server_address=PROMETHEUS)["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"],
            spec["cooldownPeriod"]) == (1, 6, 15, 360)
    assert spec["triggers"][0]["metadata"]["threshold"] == "4"


@pytest.mark.parametrize("mutate, field", [
    (lambda m: m["spec"].__setitem__("pollingInterval", 0), "spec.pollingInterval"),
    (lambda m: m["spec"].pop("triggers"), "spec.triggers"),
    (lambda m: m["spec"].__setitem__("minReplicas", 1), "spec.minReplicas"),
    (lambda m: m["spec"]["triggers"][0]["metadata"].pop("query"), "spec.triggers.0.metadata.query"),
    (lambda m: m["spec"]["triggers"][0]["metadata"].__setitem__("threshold", "five"),
     "spec.triggers.0.metadata.threshold"),
    (lambda m: m["spec"]["triggers"][0]["metadata"].__setitem__("threshold", 5),
     "spec.triggers.0.metadata.threshold"),
    (lambda m: m["spec"].__setitem__("minReplicaCount", 20), "spec.maxReplicaCount"),
    (lambda m: m.__setitem__("apiVersion", "keda.sh/v1"), "apiVersion"),
])
def test_invalid_scaled_object_is_rejected_naming_the_field(mutate, field):
    manifest = copy.deepcopy(scaled_object_manifest("vllm", server_address=PROMETHEUS))
    mutate(manifest)
    with pytest.raises(ParameterError) as err:
        validate_scaled_object(manifest)
    assert err.value.param == field


def test_quantities():
    assert [quantity(v) for v in (5, 5.0, 0.5, 12.5, 0.05)] == ["5", "5", "500m", "12500m",
                                                                  "50m"]
    with pytest.raises(ParameterError):
        scaled_object_manifest("vllm", server_address="prometheus:9090")
