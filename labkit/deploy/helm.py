"""Values for vLLM production-stack's Helm chart from a
:class:`~labkit.deploy.spec.DeploymentSpec` (:ref:`ch08-one-spec`).

The chart (vllm-project/production-stack, helm/, chart version 0.1.12) renders the engine
Deployment from ``servingEngineSpec.modelSpec[]`` with its own template
(helm/templates/deployment-vllm-multi.yaml), so the command it runs is built by the chart, not
by :func:`labkit.launch.vllm_command`: :func:`helm_values` maps each spec field onto the key
the template turns into that flag, and puts the flags the chart has no key for in
``vllmConfig.extraArgs``. Two things the template does that a reader would not guess:

- it always passes ``--host 0.0.0.0`` (the chart's router and its Service reach the pod);
- it passes ``--no-enable-prefix-caching`` unless ``vllmConfig.enablePrefixCaching`` is true,
  which turns off a vLLM default; the values set it to true to keep vLLM's behaviour.

The chart publishes a JSON schema (helm/values.schema.json), stored in
``labkit/data/production_stack_values.schema.json`` with its source;
:func:`labkit.deploy.validate.validate_helm_values` checks the values against it.
"""

from __future__ import annotations

from labkit.deploy.spec import DeploymentSpec, LIVENESS_PROBE, READINESS_PROBE, Probe

HEALTH_PATH = "/health"


def _probe(probe: Probe, port: int) -> dict:
    return {"initialDelaySeconds": probe.initial_delay_s, "periodSeconds": probe.period_s,
            "failureThreshold": probe.failure_threshold,
            "httpGet": {"path": HEALTH_PATH, "port": port}}


def helm_values(spec: DeploymentSpec) -> dict:
    """production-stack values serving ``spec`` (chapter 8): one ``modelSpec`` entry, the API
    key from the existing Secret ``api_key_secret`` (``vllmApiKey.secretName/secretKey``; a
    string there would put the key itself in the values file), and the three probes with the
    spec's startup budget."""
    repository, tag = spec.image.rsplit(":", 1)
    extra_args = ["--served-model-name", spec.served_name,
                  "--shutdown-timeout", str(spec.shutdown_timeout_s)]
    if spec.quantization is not None:
        extra_args += ["--quantization", spec.quantization]
    vllm_config = {"enablePrefixCaching": True, "dtype": spec.dtype,
                   "tensorParallelSize": spec.tensor_parallel_size,
                   "gpuMemoryUtilization": spec.gpu_memory_utilization,
                   "extraArgs": extra_args}
    if spec.max_model_len is not None:
        vllm_config["maxModelLen"] = spec.max_model_len
    if spec.max_num_seqs is not None:
        vllm_config["maxNumSeqs"] = spec.max_num_seqs
    return {
        "servingEngineSpec": {
            "vllmApiKey": {"secretName": spec.api_key_secret,
                           "secretKey": spec.api_key_secret_key},
            "containerPort": spec.port,
            "servicePort": spec.port,
            "startupProbe": _probe(spec.startup_probe, spec.port),
            "readinessProbe": _probe(READINESS_PROBE, spec.port),
            "livenessProbe": _probe(LIVENESS_PROBE, spec.port),
            "modelSpec": [{
                "name": spec.object_name,
                "repository": repository,
                "tag": tag,
                "modelURL": spec.model,
                "replicaCount": spec.replicas,
                "requestCPU": spec.cpu,
                "requestMemory": f"{spec.memory_gib}Gi",
                "limitCPU": spec.cpu,
                "limitMemory": f"{spec.memory_gib}Gi",
                "requestGPU": spec.gpus,
                "requestGPUType": spec.gpu_resource,
                "pvcStorage": f"{spec.cache_gib}Gi",
                "shmSize": f"{spec.shm_gib}Gi",
                "vllmConfig": vllm_config,
            }],
        },
    }
