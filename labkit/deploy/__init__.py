"""Deployment (:ref:`ch08-one-spec`): one :class:`DeploymentSpec`, rendered for every target.

- :mod:`labkit.deploy.spec`: the spec, its checks and the probe arithmetic;
- :mod:`labkit.deploy.render`: the ``vllm serve`` command (chapter 2's launcher), the start
  script that fixes the tutorial's, a systemd unit, a ``docker run`` line;
- :mod:`labkit.deploy.kubernetes`: Deployment, Service, PodDisruptionBudget, PVC, Secret;
- :mod:`labkit.deploy.helm`: values for vLLM production-stack's chart;
- :mod:`labkit.deploy.kserve`: a KServe InferenceService;
- :mod:`labkit.deploy.validate`: each target checked by the tool that consumes it (imported
  on its own: it needs the ``gateway`` extra).
"""

from labkit.deploy.helm import helm_values
from labkit.deploy.kserve import inference_service
from labkit.deploy.kubernetes import kubernetes_manifests
from labkit.deploy.render import deploy_script, docker_run, systemd_unit, vllm_serve_command
from labkit.deploy.spec import VLLM_IMAGE, DeploymentSpec, Probe, startup_probe

__all__ = ["VLLM_IMAGE", "DeploymentSpec", "Probe", "deploy_script", "docker_run",
           "helm_values", "inference_service", "kubernetes_manifests", "startup_probe",
           "systemd_unit", "vllm_serve_command"]
