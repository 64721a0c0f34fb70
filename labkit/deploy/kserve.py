"""A KServe InferenceService for a :class:`~labkit.deploy.spec.DeploymentSpec`
(:ref:`ch08-one-spec`).

KServe (``serving.kserve.io/v1beta1``) runs a predictor and gives it autoscaling, revisions
and canary rollouts. Its Hugging Face runtime would build its own vLLM command line from
``--model_name``/``--model_id`` arguments; a custom container runs ours instead: the
predictor holds :func:`labkit.deploy.kubernetes.vllm_container` (named ``kserve-container``,
the name KServe gives its predictor container), so the command is
:func:`labkit.launch.vllm_command` here too. It listens on ``0.0.0.0`` because in KServe's
serverless mode Knative's queue-proxy sidecar forwards requests to the container on
localhost. The InferenceService CRD is not part of the Kubernetes schema:
:func:`labkit.deploy.validate.validate_inference_service` checks it against the CRD's own
schema from KServe v0.20.0, stored in ``labkit/data/``.
"""

from __future__ import annotations

from labkit.deploy.kubernetes import labels, pod_volumes, vllm_container
from labkit.deploy.spec import DeploymentSpec

#: The predictor container's name in KServe (pkg/constants: InferenceServiceContainerName).
KSERVE_CONTAINER = "kserve-container"


def inference_service(spec: DeploymentSpec, max_replicas: int | None = None) -> dict:
    """A v1beta1 InferenceService serving ``spec`` with a custom vLLM container (chapter 8):
    ``minReplicas`` is the spec's ``replicas`` (never 0: a cold start costs the model load
    time), ``maxReplicas`` defaults to the same, so nothing scales until asked.

    The pod mounts the model-cache claim of :func:`labkit.deploy.kubernetes.cache_claim`
    (apply it too) and a memory-backed /dev/shm. In KServe's Serverless mode, Knative accepts
    those volumes only with its ``kubernetes.podspec-persistent-volume-claim`` and
    ``kubernetes.podspec-persistent-volume-write`` flags enabled (Knative docs,
    serving/services/storage); RawDeployment mode makes a plain Deployment and needs none.
    """
    metadata = {"name": spec.object_name, "labels": labels(spec)}
    if spec.namespace is not None:
        metadata["namespace"] = spec.namespace
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {"predictor": {
            "minReplicas": spec.replicas,
            "maxReplicas": spec.replicas if max_replicas is None else max_replicas,
            "terminationGracePeriodSeconds": spec.termination_grace_s,
            "containers": [vllm_container(spec, host="0.0.0.0", name=KSERVE_CONTAINER)],
            "volumes": pod_volumes(spec),
        }},
    }
