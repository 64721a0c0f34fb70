"""Every deployment target checked by the tool that consumes it (:ref:`ch08-one-spec`).

- Kubernetes manifests: ``kubernetes-validate`` against the Kubernetes 1.37 schema, offline
  and strict (an unknown field is an error, as with ``kubectl apply --validate=strict``),
  plus the cross-object rules the schema cannot express (selectors that match the pods,
  probes on a declared port);
- the systemd unit: ``systemd-analyze verify``, where systemd is installed;
- production-stack Helm values: the chart's own ``values.schema.json``;
- the KServe InferenceService: the v1beta1 CRD's schema from KServe v0.20.0 (the API server
  validates a custom resource against it), and KServe's replica rule.

Each raises :class:`~labkit.checks.ParameterError` whose ``param`` is the field at fault
(``spec.template.spec.containers.0.resources``, ``Service.Bogus``, ...). The ``vllm serve``
command is checked by vLLM's own parser in ``make test-engines``
(tests/engines/test_deploy_flags.py). Needs the ``gateway`` extra (kubernetes-validate,
PyYAML, jsonschema).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import jsonschema
import kubernetes_validate

from labkit.autoscale.manifests import KUBERNETES_VERSION, field_at_fault, strict
from labkit.checks import ParameterError
from labkit.data import read_json
from labkit.deploy.kubernetes import SECRET_PLACEHOLDER

KSERVE_VERSION = "0.20.0"
PRODUCTION_STACK_CHART_VERSION = "0.1.12"


def validate_kubernetes(manifests: Sequence[Mapping], *, ready_to_apply: bool = False,
                        kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Check each manifest against the Kubernetes schema, strict, then the rules between
    fields that the schema cannot see (chapter 8). ``ready_to_apply=True`` also rejects a
    Secret whose value is still the placeholder or empty (vLLM treats an empty
    ``VLLM_API_KEY`` as no key at all: vllm/entrypoints/serve/middleware/register.py)."""
    for manifest in manifests:
        kind = manifest.get("kind", "manifest")
        try:
            kubernetes_validate.validate(dict(manifest), kubernetes_version, strict=True)
        except jsonschema.ValidationError as err:
            where = field_at_fault(err)
            raise ParameterError(where, f"{kind}: {where}: {err.message}") from None
        except kubernetes_validate.SchemaNotFoundError as err:
            raise ParameterError("kind", f"{kind}: no schema in Kubernetes "
                                         f"{kubernetes_version}: {err}") from None
        if kind == "Deployment":
            _check_pod_template(manifest)
        if kind in ("Service", "PodDisruptionBudget"):
            _check_selector(manifest, manifests)
        if kind == "Secret" and ready_to_apply:
            for key, value in manifest.get("stringData", {}).items():
                if not value or value == SECRET_PLACEHOLDER:
                    raise ParameterError(f"stringData.{key}", f"Secret: stringData.{key} must "
                                                             f"hold the API key before it is "
                                                             f"applied, got {value!r}")


def _check_pod_template(deployment: Mapping) -> None:
    spec = deployment["spec"]
    selector = spec["selector"].get("matchLabels", {})
    pod_labels = spec["template"].get("metadata", {}).get("labels", {})
    for key, value in selector.items():
        if pod_labels.get(key) != value:
            raise ParameterError("spec.selector.matchLabels",
                                 f"Deployment: spec.selector.matchLabels {key}={value} does "
                                 f"not select the pod template's labels {pod_labels}")
    pod = spec["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for i, container in enumerate(pod["containers"]):
        where = f"spec.template.spec.containers.{i}"
        ports = {p.get("name") for p in container.get("ports", [])} | {
            p["containerPort"] for p in container.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = container.get(probe, {}).get("httpGet", {}).get("port")
            if port is not None and port not in ports:
                raise ParameterError(f"{where}.{probe}.httpGet.port",
                                     f"Deployment: {where}.{probe}.httpGet.port {port!r} is "
                                     f"not a port of the container ({sorted(map(str, ports))})")
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                raise ParameterError(f"{where}.volumeMounts",
                                     f"Deployment: {where}.volumeMounts mounts "
                                     f"{mount['name']!r}, which is not a volume of the pod")


def _check_selector(manifest: Mapping, manifests: Sequence[Mapping]) -> None:
    """A Service or PodDisruptionBudget must select the pods of a Deployment in the set."""
    spec = manifest["spec"]
    field = "spec.selector" if manifest["kind"] == "Service" else "spec.selector.matchLabels"
    selector = spec.get("selector", {}) if manifest["kind"] == "Service" else \
        spec.get("selector", {}).get("matchLabels", {})
    pods = [m["spec"]["template"].get("metadata", {}).get("labels", {})
            for m in manifests if m.get("kind") == "Deployment"]
    if pods and not any(all(p.get(k) == v for k, v in selector.items()) for p in pods):
        raise ParameterError(field, f"{manifest['kind']}: {field} {selector} selects no pod "
                                    f"of the Deployment")


# ---------------------------------------------------------------------------------------------
# systemd
# ---------------------------------------------------------------------------------------------

def systemd_analyze() -> str | None:
    """The path of ``systemd-analyze``, or None where systemd is not installed."""
    return shutil.which("systemd-analyze")


_UNKNOWN = re.compile(r"Unknown (?:key|section) '?([^' ]+)'?(?: in section \[(\w+)\])?")


def verify_systemd_unit(unit_text: str, unit_name: str = "vllm.service") -> None:
    """Run ``systemd-analyze verify`` on the unit (chapter 8). systemd only warns about an
    unknown key and keeps going, which hides typos, so any diagnostic it prints about the
    unit is an error here; the ``param`` is ``Section.Key`` or the directive at fault
    (``ExecStart`` when the executable is missing). Raises RuntimeError where systemd is
    absent (check :func:`systemd_analyze` first)."""
    tool = systemd_analyze()
    if tool is None:
        raise RuntimeError("systemd-analyze is not installed: the unit cannot be verified here")
    if not unit_name.endswith(".service"):
        raise ParameterError("unit_name", f"unit_name must end in .service, got {unit_name!r}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / unit_name
        path.write_text(unit_text)
        result = subprocess.run([tool, "verify", "--man=no", str(path)], capture_output=True,
                                text=True, timeout=60)
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if unit_name in line or str(path) in line]
    if result.returncode != 0 or lines:
        message = "\n".join(lines) or (result.stdout + result.stderr).strip()
        raise ParameterError(_systemd_param(message), f"systemd-analyze verify: {message}")


def _systemd_param(message: str) -> str:
    match = _UNKNOWN.search(message)
    if match:
        return f"{match[2]}.{match[1]}" if match[2] else match[1]
    for directive in ("ExecStart", "EnvironmentFile", "User", "Type", "Restart"):
        if directive in message or (directive == "ExecStart" and "Command " in message):
            return directive
    return "unit"


# ---------------------------------------------------------------------------------------------
# Schemas stored in labkit/data: production-stack's values, KServe's InferenceService CRD
# ---------------------------------------------------------------------------------------------

@functools.cache
def _stored_schema(filename: str) -> dict:
    """A schema from ``labkit/data``, read and parsed once."""
    return read_json(filename)


def _check(schema: Mapping, instance: Mapping, what: str) -> None:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(instance))
    if error is not None:
        where = field_at_fault(error)
        raise ParameterError(where, f"{what}: {where}: {error.message}")


def validate_helm_values(values: Mapping) -> None:
    """Check Helm values against production-stack's published ``values.schema.json`` (chart
    0.1.12, stored in labkit/data with its source), strictly: an unknown field is an error
    (chapter 8)."""
    _check(strict(_stored_schema("production_stack_values.schema.json")), values,
           "production-stack values")


_ISVC_ENVELOPE = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
                  "properties": {"apiVersion": {"const": "serving.kserve.io/v1beta1"},
                                 "kind": {"const": "InferenceService"},
                                 "metadata": {"type": "object", "required": ["name"]}}}


def validate_inference_service(manifest: Mapping) -> None:
    """Check a KServe InferenceService against the v1beta1 CRD schema of KServe v0.20.0
    (config/crd/full/serving.kserve.io_inferenceservices.yaml, stored in labkit/data),
    strict, and KServe's webhook rule ``minReplicas <= maxReplicas``
    (pkg/apis/serving/v1beta1/component.go, validateReplicas) (chapter 8)."""
    _check(_ISVC_ENVELOPE, manifest, "InferenceService")
    _check(strict(_stored_schema("kserve_inferenceservice_v1beta1.schema.json")), manifest,
           "InferenceService")
    predictor = manifest["spec"]["predictor"]
    low, high = predictor.get("minReplicas", 1), predictor.get("maxReplicas", 0)
    if low < 0:
        raise ParameterError("spec.predictor.minReplicas",
                             f"InferenceService: spec.predictor.minReplicas cannot be less "
                             f"than 0, got {low}")
    if high < 0:
        raise ParameterError("spec.predictor.maxReplicas",
                             f"InferenceService: spec.predictor.maxReplicas cannot be less "
                             f"than 0, got {high}")
    if high and low > high:  # maxReplicas 0 means "no maximum"
        raise ParameterError("spec.predictor.maxReplicas",
                             f"InferenceService: spec.predictor.minReplicas ({low}) cannot "
                             f"be greater than spec.predictor.maxReplicas ({high})")
