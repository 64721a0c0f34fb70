"""Kubernetes manifests for a :class:`~labkit.deploy.spec.DeploymentSpec` (:ref:`ch08-one-spec`).

:func:`kubernetes_manifests` returns plain dicts: a Deployment whose container runs
:func:`labkit.deploy.render.vllm_serve_command` with startup, readiness and liveness probes on
vLLM's ``/health``, a ClusterIP Service, a PodDisruptionBudget, the model-cache
PersistentVolumeClaim and, when asked, the API-key Secret. :func:`vllm_container` is the one
container definition, shared with the KServe target. Validate them with
:func:`labkit.deploy.validate.validate_kubernetes`; dump them with
:func:`labkit.autoscale.manifests.to_yaml`.
"""

from __future__ import annotations

from labkit.deploy.render import vllm_serve_command
from labkit.deploy.spec import (API_KEY_ENV, CONTAINER_CACHE, LIVENESS_PROBE, READINESS_PROBE,
                                DeploymentSpec, Probe)

#: The container port's name; the probes and the Service refer to the port by it.
PORT_NAME = "http"

#: vLLM's health route: 200 while the engine runs, an error once the engine has died
#: (vllm/entrypoints/serve/instrumentator/health.py), so one route serves all three probes.
HEALTH_PATH = "/health"

#: The pod's own IP as a container argument: Kubernetes expands ``$(POD_IP)`` in ``command``
#: from the environment variable of that name, which the downward API fills.
POD_IP = "$(POD_IP)"

#: What ``stringData`` holds in the optional Secret until the user puts the key there.
SECRET_PLACEHOLDER = "replace with the API key (for example: openssl rand -hex 32)"


def labels(spec: DeploymentSpec) -> dict[str, str]:
    """The labels that tie the pods to their Deployment, Service and PodDisruptionBudget
    (Kubernetes' recommended ``app.kubernetes.io`` labels)."""
    return {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": spec.object_name}


def _metadata(spec: DeploymentSpec, name: str | None = None) -> dict:
    meta = {"name": name or spec.object_name, "labels": labels(spec)}
    if spec.namespace is not None:
        meta["namespace"] = spec.namespace
    return meta


def _probe(probe: Probe) -> dict:
    out = {"httpGet": {"path": HEALTH_PATH, "port": PORT_NAME},
           "periodSeconds": probe.period_s, "failureThreshold": probe.failure_threshold}
    if probe.initial_delay_s:
        out["initialDelaySeconds"] = probe.initial_delay_s
    return out


def vllm_container(spec: DeploymentSpec, host: str, name: str = "vllm") -> dict:
    """The vLLM container (chapter 8): :func:`~labkit.deploy.vllm_serve_command` listening on
    ``host`` (:data:`POD_IP` adds the variable it expands from), the API key from the Secret
    ``api_key_secret`` (not optional: a missing Secret keeps the pod from starting instead of
    starting it without a key), requests equal to limits, the cache and /dev/shm mounted,
    and the three probes.

    The startup probe's budget comes from the spec's load time
    (:func:`~labkit.deploy.spec.startup_probe`); the liveness and readiness probes only start
    after it succeeds.
    """
    resources = {"cpu": str(spec.cpu), "memory": f"{spec.memory_gib}Gi",
                 spec.gpu_resource: str(spec.gpus)}
    return {
        "name": name,
        "image": spec.image,
        "command": vllm_serve_command(spec, host=host),
        "env": [
            *([{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
              if host == POD_IP else []),
            {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
                "name": spec.api_key_secret, "key": spec.api_key_secret_key,
                "optional": False}}},
            {"name": "HF_HOME", "value": CONTAINER_CACHE},
        ],
        "ports": [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [{"name": "model-cache", "mountPath": CONTAINER_CACHE},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "startupProbe": _probe(spec.startup_probe),
        "readinessProbe": _probe(READINESS_PROBE),
        "livenessProbe": _probe(LIVENESS_PROBE),
    }


def pod_volumes(spec: DeploymentSpec) -> list[dict]:
    """The model cache (the PVC named after the deployment) and /dev/shm: a memory-backed
    emptyDir of ``shm_gib`` GiB, because a container's default /dev/shm is 64 MiB, too small
    for PyTorch's shared-memory tensors between tensor-parallel workers."""
    return [{"name": "model-cache",
             "persistentVolumeClaim": {"claimName": f"{spec.object_name}-cache"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{spec.shm_gib}Gi"}}]


def deployment(spec: DeploymentSpec) -> dict:
    """An ``apps/v1`` Deployment of ``replicas`` pods, each listening on its pod IP.

    ``terminationGracePeriodSeconds`` (the spec's ``termination_grace_s``, Kubernetes'
    default is 30 s) leaves vLLM time to drain its running requests for
    ``shutdown_timeout_s`` after SIGTERM and exit before SIGKILL."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels(spec)},
            "template": {
                "metadata": {"labels": labels(spec)},
                "spec": {
                    "terminationGracePeriodSeconds": spec.termination_grace_s,
                    "containers": [vllm_container(spec, host=POD_IP)],
                    "volumes": pod_volumes(spec),
                },
            },
        },
    }


def service(spec: DeploymentSpec) -> dict:
    """A ClusterIP Service: reachable inside the cluster only; a gateway or an Ingress with
    TLS and authentication is what faces the outside."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(spec),
            "spec": {"type": "ClusterIP", "selector": labels(spec),
                     "ports": [{"name": PORT_NAME, "port": spec.port,
                                "targetPort": PORT_NAME, "protocol": "TCP"}]}}


def pod_disruption_budget(spec: DeploymentSpec) -> dict:
    """A ``policy/v1`` PodDisruptionBudget: voluntary evictions (node drains, upgrades) take
    at most one replica at a time. ``maxUnavailable: 1`` rather than ``minAvailable``: with a
    single replica, a budget that allows no disruption would block every node drain forever."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(spec),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(spec)}}}


def cache_claim(spec: DeploymentSpec) -> dict:
    """The model cache's PersistentVolumeClaim of ``cache_gib`` GiB, so a restarted pod finds
    the weights instead of downloading them again. One replica: ReadWriteOnce; more replicas
    share it and need ReadWriteMany (a storage class that offers it, such as NFS or CephFS)."""
    mode = "ReadWriteOnce" if spec.replicas == 1 else "ReadWriteMany"
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(spec, f"{spec.object_name}-cache"),
            "spec": {"accessModes": [mode],
                     "resources": {"requests": {"storage": f"{spec.cache_gib}Gi"}}}}


def api_key_secret(spec: DeploymentSpec) -> dict:
    """The API-key Secret with a placeholder in ``stringData`` that the user replaces before
    applying it (:func:`labkit.deploy.validate.validate_kubernetes` rejects it while the
    placeholder is there, unless told it is a template): the key itself never lives in
    generated files."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": _metadata(spec, spec.api_key_secret), "type": "Opaque",
            "stringData": {spec.api_key_secret_key: SECRET_PLACEHOLDER}}


def kubernetes_manifests(spec: DeploymentSpec, include_secret: bool = False) -> list[dict]:
    """Everything to ``kubectl apply`` for ``spec`` (chapter 8): PVC, Deployment, Service,
    PodDisruptionBudget.

    By default the Deployment refers to an existing Secret ``api_key_secret``, created
    outside any file, e.g. ``kubectl create secret generic vllm-api-key
    --from-literal=api-key="$(openssl rand -hex 32)"``. ``include_secret=True`` adds that
    Secret with a placeholder to fill in (:func:`~labkit.deploy.kubernetes.api_key_secret`).
    """
    manifests = [cache_claim(spec), deployment(spec), service(spec),
                 pod_disruption_budget(spec)]
    return [api_key_secret(spec), *manifests] if include_secret else manifests
