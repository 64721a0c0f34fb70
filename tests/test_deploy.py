"""labkit.deploy (chapter 8): one spec rendered for every target, each target accepted by the
tool that consumes it, broken ones rejected naming the field, and the start script run for
real with ``labkit serve`` standing in for ``vllm serve``."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from labkit.autoscale.manifests import to_yaml
from labkit.checks import ParameterError
from labkit.deploy import (DeploymentSpec, deploy_script, docker_run, helm_values,
                           inference_service, kubernetes_manifests, startup_probe, systemd_unit,
                           vllm_serve_command)
from labkit.deploy.kubernetes import SECRET_PLACEHOLDER
from labkit.deploy.validate import (systemd_analyze, validate_helm_values,
                                    validate_inference_service, validate_kubernetes,
                                    verify_systemd_unit)
from labkit.engine import write_tiny_model
from labkit.launch import ServeConfig, labkit_command, vllm_command
from labkit.process import free_port

SPEC = DeploymentSpec(model="hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
                      served_model_name="llama-70b", tensor_parallel_size=4,
                      max_model_len=8192, quantization="awq", max_num_seqs=64)
SPECS = [SPEC, DeploymentSpec(model="Qwen/Qwen2.5-7B-Instruct", name="qwen",
                              dtype="bfloat16", replicas=3, namespace="serving", port=8080)]


# ---------------------------------------------------------------------------------------------
# The spec and its arithmetic
# ---------------------------------------------------------------------------------------------

def test_startup_budget_covers_the_load_time_with_margin():
    # The docstring's example: 82 s x 1.5 = 123 s -> 13 checks of 10 s = 130 s.
    probe = startup_probe(82.0)
    assert (probe.period_s, probe.failure_threshold, probe.budget_s) == (10, 13, 130)
    assert SPEC.startup_probe == probe  # the spec's default load time is COLD_START_S = 82 s
    assert startup_probe(294.0).failure_threshold == 45  # a clean pod: download first
    # 100 s x 1.1 is 110.00000000000001 in floating point: still 11 checks, not 12.
    assert startup_probe(100.0, margin=1.1).failure_threshold == 11
    for load_s in (1.0, 59.9, 60.0, 61.0, 500.0):
        budget = startup_probe(load_s, margin=1.2).budget_s
        assert 1.2 * load_s <= budget < 1.2 * load_s + 10


@pytest.mark.parametrize("field, value", [
    ("tensor_parallel_size", 0), ("gpu_memory_utilization", 1.5), ("port", 70000),
    ("host", "localhost:8000"), ("name", "Llama_70B"), ("api_key_secret", "Key!"),
    ("gpu_count", 2), ("dtype", "fp64"), ("shm_gib", 64), ("image", "vllm/vllm-openai"),
    ("image", "vllm/vllm-openai:latest"), ("model_load_s", 0), ("quantization", "AWQ 4bit"),
    ("gpu_resource", "gpu"), ("max_model_len", -1),
])
def test_a_bad_spec_is_rejected_naming_the_field(field, value):
    options = {"model": "m", "served_model_name": "m", "tensor_parallel_size": 4, field: value}
    with pytest.raises(ParameterError) as err:
        DeploymentSpec(**options)
    assert err.value.param == field
    assert field in str(err.value)


def test_the_drain_fits_inside_the_grace_period():
    # vLLM's --shutdown-timeout defaults to 0: SIGTERM aborts running requests. The spec
    # drains them, and the pod's grace period outlasts the drain.
    spec = DeploymentSpec(model="m", name="m", shutdown_timeout_s=45, termination_grace_s=90)
    assert vllm_serve_command(spec)[-2:] == ["--shutdown-timeout", "45"]
    pod = next(m for m in kubernetes_manifests(spec) if m["kind"] == "Deployment")
    assert pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    assert "STOP_GRACE_S=90" in deploy_script(spec)
    with pytest.raises(ParameterError, match="shutdown_timeout_s must be below") as err:
        DeploymentSpec(model="m", name="m", shutdown_timeout_s=60)
    assert err.value.param == "shutdown_timeout_s"


def test_a_served_name_that_is_no_dns_label_asks_for_a_name():
    with pytest.raises(ParameterError, match="set name=") as err:
        DeploymentSpec(model="Qwen/Qwen2.5-7B-Instruct")
    assert err.value.param == "name"


# ---------------------------------------------------------------------------------------------
# The command and the local targets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_the_command_is_chapter_2s_launcher(spec):
    expected = vllm_command(ServeConfig(
        model=spec.model, served_model_name=spec.served_name, host=spec.host, port=spec.port,
        tensor_parallel_size=spec.tensor_parallel_size,
        gpu_memory_utilization=spec.gpu_memory_utilization, max_model_len=spec.max_model_len,
        quantization=spec.quantization, dtype=spec.dtype, max_num_seqs=spec.max_num_seqs,
        shutdown_timeout=spec.shutdown_timeout_s))
    assert vllm_serve_command(spec) == expected
    assert "--trust-remote-code" not in expected and "--enforce-eager" not in expected
    # Every other target runs the same list, with only the listening address changed.
    in_container = vllm_command(spec.serve_config(host="0.0.0.0"))
    assert docker_run(spec)[-len(in_container) + 2:] == in_container[2:]
    deployment = next(m for m in kubernetes_manifests(spec) if m["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == vllm_command(spec.serve_config(host="$(POD_IP)"))
    predictor = inference_service(spec)["spec"]["predictor"]["containers"][0]
    assert predictor["command"] == in_container


def test_docker_publishes_on_loopback_and_keeps_the_key_off_the_line():
    line = docker_run(SPEC)
    assert line[line.index("-p") + 1] == "127.0.0.1:8000:8000"
    assert line[line.index("--gpus") + 1] == "4"
    assert line[line.index("--env") + 1] == "VLLM_API_KEY"  # no "=value"
    assert line[line.index("vllm/vllm-openai:v0.32.0") + 1] == SPEC.model


@pytest.mark.skipif(systemd_analyze() is None, reason="systemd-analyze is not installed")
def test_systemd_unit_passes_systemd_analyze(tmp_path):
    vllm = tmp_path / "vllm"  # systemd-analyze checks that ExecStart's program exists
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    unit = systemd_unit(SPEC, vllm_executable=str(vllm))
    verify_systemd_unit(unit, "llama-70b.service")
    assert "Restart=on-failure" in unit and "DynamicUser=yes" in unit
    assert "EnvironmentFile=/etc/vllm/llama-70b.env" in unit
    assert f"ExecStart={vllm} serve {SPEC.model} --host 127.0.0.1" in unit


@pytest.mark.skipif(systemd_analyze() is None, reason="systemd-analyze is not installed")
def test_a_broken_systemd_unit_is_rejected(tmp_path):
    with pytest.raises(ParameterError) as err:  # vLLM is not installed at the default path
        verify_systemd_unit(systemd_unit(SPEC, vllm_executable="/nonexistent/vllm"))
    assert err.value.param == "ExecStart"
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    typo = systemd_unit(SPEC, vllm_executable=str(vllm)).replace("Restart=", "Restrat=")
    with pytest.raises(ParameterError, match="Unknown key") as err:
        verify_systemd_unit(typo)
    assert err.value.param == "Service.Restrat"


# ---------------------------------------------------------------------------------------------
# Kubernetes, Helm, KServe
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_kubernetes_manifests_pass_the_kubernetes_schema(spec):
    manifests = kubernetes_manifests(spec, include_secret=True)
    validate_kubernetes(manifests)
    kinds = [m["kind"] for m in manifests]
    assert kinds == ["Secret", "PersistentVolumeClaim", "Deployment", "Service",
                     "PodDisruptionBudget"]
    by_kind = dict(zip(kinds, manifests, strict=True))
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["startupProbe"]["failureThreshold"] * \
        container["startupProbe"]["periodSeconds"] >= spec.startup_margin * spec.model_load_s
    assert {p: container[p]["httpGet"]["path"] for p in
            ("startupProbe", "readinessProbe", "livenessProbe")} == dict.fromkeys(
        ("startupProbe", "readinessProbe", "livenessProbe"), "/health")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(spec.gpus)
    assert {"name": "dshm", "emptyDir": {"medium": "Memory",
                                         "sizeLimit": f"{spec.shm_gib}Gi"}} in pod["volumes"]
    assert by_kind["Service"]["spec"]["type"] == "ClusterIP"
    key = next(e for e in container["env"] if e["name"] == "VLLM_API_KEY")
    assert key["valueFrom"]["secretKeyRef"]["name"] == spec.api_key_secret
    assert "Secret" not in [m["kind"] for m in kubernetes_manifests(spec)]
    assert to_yaml(*manifests).count("\n---\n") == 4


def _deployment(spec=SPEC):
    return next(m for m in kubernetes_manifests(spec) if m["kind"] == "Deployment")


def test_broken_kubernetes_manifests_are_rejected_naming_the_field():
    deployment = _deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo
    with pytest.raises(ParameterError, match="resource") as err:
        validate_kubernetes([deployment])
    assert err.value.param == "spec.template.spec.containers.0.resource"

    deployment = _deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"][
        "periodSeconds"] = "10s"
    with pytest.raises(ParameterError) as err:
        validate_kubernetes([deployment])
    assert err.value.param == "spec.template.spec.containers.0.livenessProbe.periodSeconds"

    deployment = _deployment()
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"][
        "port"] = "metrics"
    with pytest.raises(ParameterError, match="not a port") as err:
        validate_kubernetes([deployment])
    assert err.value.param == "spec.template.spec.containers.0.startupProbe.httpGet.port"

    service = next(m for m in kubernetes_manifests(SPEC) if m["kind"] == "Service")
    service["spec"]["selector"] = {"app.kubernetes.io/name": "sglang"}
    with pytest.raises(ParameterError, match="selects no pod") as err:
        validate_kubernetes([_deployment(), service])
    assert err.value.param == "spec.selector"


def test_the_secret_template_is_not_ready_to_apply_until_filled():
    manifests = kubernetes_manifests(SPEC, include_secret=True)
    validate_kubernetes(manifests)  # a valid template
    with pytest.raises(ParameterError) as err:
        validate_kubernetes(manifests, ready_to_apply=True)
    assert err.value.param == "stringData.api-key"
    assert manifests[0]["stringData"]["api-key"] == SECRET_PLACEHOLDER
    manifests[0]["stringData"]["api-key"] = "d6f1c0"
    validate_kubernetes(manifests, ready_to_apply=True)


@pytest.mark.parametrize("spec", SPECS)
def test_helm_values_pass_production_stacks_schema(spec):
    values = helm_values(spec)
    validate_helm_values(values)
    engine = values["servingEngineSpec"]
    model = engine["modelSpec"][0]
    assert (model["repository"], model["tag"]) == ("vllm/vllm-openai", "v0.32.0")
    assert model["vllmConfig"]["enablePrefixCaching"] is True  # else the chart turns it off
    assert engine["vllmApiKey"] == {"secretName": spec.api_key_secret,
                                    "secretKey": spec.api_key_secret_key}
    assert engine["startupProbe"]["failureThreshold"] == spec.startup_probe.failure_threshold


def test_broken_helm_values_are_rejected_naming_the_field():
    values = helm_values(SPEC)
    values["servingEngineSpec"]["modelSpec"][0]["requestCPU"] = "eight"
    with pytest.raises(ParameterError) as err:
        validate_helm_values(values)
    assert err.value.param == "servingEngineSpec.modelSpec.0.requestCPU"

    values = helm_values(SPEC)
    values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["maxNumSeq"] = 64  # typo
    with pytest.raises(ParameterError) as err:
        validate_helm_values(values)
    assert err.value.param == "servingEngineSpec.modelSpec.0.vllmConfig.maxNumSeq"

    values = helm_values(SPEC)
    values["servingEngineSpec"]["vllmApiKey"] = ["vllm-api-key"]  # a string or an object
    with pytest.raises(ParameterError) as err:
        validate_helm_values(values)
    assert err.value.param == "servingEngineSpec.vllmApiKey"


@pytest.mark.parametrize("spec", SPECS)
def test_inference_service_passes_kserves_crd_schema(spec):
    isvc = inference_service(spec)
    validate_inference_service(isvc)
    predictor = isvc["spec"]["predictor"]
    assert predictor["containers"][0]["name"] == "kserve-container"
    assert predictor["minReplicas"] == spec.replicas


def test_broken_inference_services_are_rejected_naming_the_field():
    isvc = inference_service(SPEC)
    isvc["spec"]["predictor"]["scaleMetric"] = "queue"  # not one of the CRD's enum
    with pytest.raises(ParameterError) as err:
        validate_inference_service(isvc)
    assert err.value.param == "spec.predictor.scaleMetric"

    isvc = inference_service(SPEC)
    isvc["spec"]["predictor"]["containers"][0]["startupProbe"]["periodSecond"] = 10  # typo
    with pytest.raises(ParameterError) as err:
        validate_inference_service(isvc)
    assert err.value.param == "spec.predictor.containers.0.startupProbe.periodSecond"

    with pytest.raises(ParameterError) as err:
        validate_inference_service(inference_service(SPECS[1], max_replicas=2))
    assert err.value.param == "spec.predictor.maxReplicas"

    isvc = inference_service(SPEC)
    isvc["apiVersion"] = "serving.kserve.io/v1alpha1"
    with pytest.raises(ParameterError) as err:
        validate_inference_service(isvc)
    assert err.value.param == "apiVersion"


# ---------------------------------------------------------------------------------------------
# The start script, run for real
# ---------------------------------------------------------------------------------------------

def _group_gone(pgid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _server_pid(stderr: str) -> int:
    line = next(line for line in stderr.splitlines() if line.startswith("server pid "))
    return int(line.split()[2].rstrip(","))


def _run_script(tmp_path, spec, command, env=None):
    script = tmp_path / "deploy.sh"
    script.write_text(deploy_script(spec, stop_grace_s=10))
    return subprocess.Popen(["bash", str(script), *command], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "LOG_FILE": str(tmp_path / "server.log"),
                                 **(env or {})})


def test_the_script_starts_waits_for_health_and_stops_the_server(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    spec = DeploymentSpec(model=str(model), served_model_name="tiny", port=free_port(),
                          model_load_s=20)
    command = labkit_command(spec.serve_config())  # the teaching engine stands in for vLLM
    script = _run_script(tmp_path, spec, command, env={"VLLM_API_KEY": "test-key"})
    base = f"http://127.0.0.1:{spec.port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and script.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        # The key came from the environment: /v1 answers only with it.
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 401
        assert httpx.get(base + "/v1/models", timeout=5,
                         headers={"Authorization": "Bearer test-key"}).status_code == 200
        # Stopped once the script's own health check has passed (it prints "healthy: URL";
        # a script that never gets there exits at its startup timeout, ending the read).
        lines = []
        for line in script.stderr:
            lines.append(line)
            if line.startswith("healthy:"):
                break
        script.send_signal(signal.SIGTERM)
        _, rest = script.communicate(timeout=30)
        stderr = "".join(lines) + rest
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
    assert script.returncode == 143, stderr
    assert f"healthy: {base}/health" in stderr
    assert "stopping server" in stderr
    assert _group_gone(_server_pid(stderr)), "the server outlived the script"
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)


def test_the_script_gives_up_on_a_server_that_never_gets_healthy(tmp_path):
    spec = DeploymentSpec(model="m", served_model_name="m", port=free_port())
    script = _run_script(tmp_path, spec, ["sleep", "60"], env={"STARTUP_TIMEOUT_S": "2"})
    _, stderr = script.communicate(timeout=30)
    assert script.returncode == 1
    assert "not healthy after 2 s" in stderr
    assert _group_gone(_server_pid(stderr)), "the unhealthy server was left running"


def test_the_script_reports_a_server_that_exits(tmp_path):
    spec = DeploymentSpec(model="m", served_model_name="m", port=free_port())
    command = [sys.executable, "-c", "import sys; print('bad flag: --swap-space'); sys.exit(2)"]
    script = _run_script(tmp_path, spec, command)
    _, stderr = script.communicate(timeout=30)
    assert script.returncode == 1
    assert "exited before it was healthy" in stderr and "bad flag: --swap-space" in stderr


def test_the_default_server_command_is_vllm_serve():
    script = deploy_script(SPEC)
    assert ("server_command=(vllm serve hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4 "
            "--host 127.0.0.1") in script
    assert "set -euo pipefail" in script and "trap stop_server EXIT" in script
    assert 'STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-130}"' in script
