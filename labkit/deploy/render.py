"""The local targets of a :class:`~labkit.deploy.spec.DeploymentSpec` (:ref:`ch08-one-spec`): the
``vllm serve`` command, a start script, a systemd unit and a ``docker run`` line.

The command is chapter 2's :func:`labkit.launch.vllm_command`; every other target wraps that
same list, so no flag is written twice. Kubernetes, Helm and KServe are in
:mod:`labkit.deploy.kubernetes`, :mod:`labkit.deploy.helm` and :mod:`labkit.deploy.kserve`.
"""

from __future__ import annotations

import shlex

from labkit.checks import ParameterError
from labkit.deploy.spec import API_KEY_ENV, CONTAINER_CACHE, DeploymentSpec
from labkit.launch import vllm_command


def vllm_serve_command(spec: DeploymentSpec, host: str | None = None) -> list[str]:
    """``vllm serve`` for ``spec`` (chapter 8), exactly :func:`labkit.launch.vllm_command` of
    :meth:`DeploymentSpec.serve_config`; ``host`` overrides where it listens (containers)."""
    return vllm_command(spec.serve_config(host))


def _health_url(spec: DeploymentSpec) -> str:
    host = "127.0.0.1" if spec.host in ("0.0.0.0", "::") else spec.host
    return f"http://{f'[{host}]' if ':' in host else host}:{spec.port}/health"


#: The server command of the tutorial's chapter 8 ``deploy_vllm.sh``, its variables filled
#: in, as the script runs it (``python -m vllm.entrypoints.openai.api_server``, then a pipe
#: into ``tee``). Kept to be judged by vLLM's own parser (tests/engines/test_deploy_flags.py).
TUTORIAL_SERVER_ARGS = (
    "--model", "meta-llama/Llama-3-70B-Instruct", "--served-model-name", "llama-70b",
    "--tensor-parallel-size", "4", "--port", "8000", "--max-model-len", "8192",
    "--gpu-memory-utilization", "0.90", "--quantization", "awq", "--dtype", "auto",
    "--trust-remote-code", "--disable-log-requests", "--max-num-seqs", "64",
    "--max-num-batched-tokens", "8192", "--swap-space", "4", "--enforce-eager",
)

#: What is wrong with the tutorial's script, and what :func:`deploy_script` does instead.
TUTORIAL_SCRIPT_PROBLEMS = {
    "--disable-log-requests": "the default anyway: request logging is off unless "
                              "--enable-log-requests (engine/arg_utils.py); vllm 0.32.0's "
                              "parser rejects the flag, 0.33.0 accepts it again as the "
                              "negative of --enable-log-requests",
    "--swap-space": "gone from vLLM: its parser rejects it (0.32.0 and 0.33.0), no "
                    "swap_space option is left",
    "--trust-remote-code": "runs Python code from the model repository; Llama needs none",
    "--enforce-eager": "turns CUDA graphs off, slowing every decode step; a debugging flag",
    "python -m vllm.entrypoints.openai.api_server": "deprecated since vLLM 0.32.0, which "
                                                    "warns when started this way: the entry "
                                                    "point is `vllm serve`",
    "no --host": "vLLM binds (host or '', port), every interface, by default "
                 "(entrypoints/launchers/launcher.py); bind 127.0.0.1 behind a proxy",
    "no API key": "anyone who reaches the port can use the GPUs; VLLM_API_KEY from a secret",
    "| tee without pipefail": "the pipeline's status is tee's: a crashed server looks fine",
    "no health wait": "the script returns before the model is loaded (minutes for 70B)",
    "no stop": "nothing stops the server or its workers when the script is interrupted",
    "meta-llama/Llama-3-70B-Instruct": "not the id of Meta's repository "
                                       "(meta-llama/Meta-Llama-3-70B-Instruct), whose "
                                       "weights are BF16, not AWQ: --quantization awq needs "
                                       "an AWQ checkpoint",
}


def deploy_script(spec: DeploymentSpec, stop_grace_s: int | None = None) -> str:
    """The tutorial's chapter 8 deploy script, fixed: a bash script that starts the server,
    waits for ``/health`` and stops it cleanly (chapter 8).

    - ``set -euo pipefail``: a failing command stops the script (the tutorial pipes the server
      into ``tee``, whose exit status hides the server's);
    - the server command is the script's arguments when it has any (``labkit serve ...`` on a
      laptop), else :func:`vllm_serve_command`; the API key comes from ``VLLM_API_KEY`` in the
      environment, never from the command line, where ``ps`` would show it;
    - the server runs in its own session (``setsid``), so stopping it stops every process it
      spawned (vLLM runs its engine core and tensor-parallel workers as child processes);
    - it waits for ``/health`` for at most ``STARTUP_TIMEOUT_S`` seconds (default: the spec's
      startup probe budget) and fails with the log's tail if the server exits or never gets
      healthy;
    - a trap on EXIT (reached on INT and TERM too) sends SIGTERM to the server's process group,
      waits up to ``stop_grace_s`` seconds (default: the spec's ``termination_grace_s``, longer
      than the ``--shutdown-timeout`` drain) for the server to exit, then SIGKILLs whatever is
      left of the group: no orphan when the script is stopped.

    Environment: ``LOG_FILE`` (default ``./<name>.log``), ``STARTUP_TIMEOUT_S``. Needs bash,
    ``curl``, ``ps`` and ``setsid`` (util-linux), all present on common Linux distributions.
    """
    stop_grace_s = spec.termination_grace_s if stop_grace_s is None else stop_grace_s
    if not isinstance(stop_grace_s, int) or stop_grace_s < 1:
        raise ParameterError("stop_grace_s", f"stop_grace_s must be a positive integer, "
                                             f"got {stop_grace_s!r}")
    default_command = " ".join(shlex.quote(arg) for arg in vllm_serve_command(spec))
    return f"""#!/usr/bin/env bash
# Start {spec.served_name} with vLLM, wait until it is healthy, stop it cleanly on exit.
# Generated by labkit.deploy (chapter 8). Usage: {spec.object_name}.sh [SERVER COMMAND...]
set -euo pipefail

HEALTH_URL={shlex.quote(_health_url(spec))}
STARTUP_TIMEOUT_S="${{STARTUP_TIMEOUT_S:-{spec.startup_probe.budget_s}}}"
STOP_GRACE_S={stop_grace_s}
LOG_FILE="${{LOG_FILE:-./{spec.object_name}.log}}"

if [ "$#" -gt 0 ]; then
  server_command=("$@")
else
  server_command=({default_command})
fi

server_pid=""
# True while the server's main process runs; a zombie (exited, not yet reaped) counts as gone.
server_running() {{
  local state
  state=$(ps -o stat= -p "$server_pid" 2>/dev/null | tr -d ' ' || true)
  [ -n "$state" ] && [ "${{state#Z}}" = "$state" ]
}}
stop_server() {{
  [ -n "$server_pid" ] || return 0
  if server_running; then
    echo "stopping server (process group $server_pid)" >&2
    kill -TERM -- "-$server_pid" 2>/dev/null || true
    for _ in $(seq $((STOP_GRACE_S * 5))); do
      server_running || break
      sleep 0.2
    done
  fi
  # Whatever is left of the group: the server after its grace period, or its workers.
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
}}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

setsid "${{server_command[@]}}" >>"$LOG_FILE" 2>&1 &
server_pid=$!
echo "server pid $server_pid, log $LOG_FILE" >&2

deadline=$((SECONDS + STARTUP_TIMEOUT_S))
until curl --silent --fail --max-time 5 --output /dev/null "$HEALTH_URL"; do
  if ! server_running; then
    echo "server exited before it was healthy; last lines of $LOG_FILE:" >&2
    tail -n 20 "$LOG_FILE" >&2
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "server not healthy after $STARTUP_TIMEOUT_S s; last lines of $LOG_FILE:" >&2
    tail -n 20 "$LOG_FILE" >&2
    exit 1
  fi
  sleep 1
done
echo "healthy: $HEALTH_URL" >&2

wait "$server_pid"
"""


def systemd_unit(spec: DeploymentSpec, vllm_executable: str = "/opt/vllm/bin/vllm",
                 environment_file: str | None = None) -> str:
    """A systemd service unit that runs :func:`vllm_serve_command` (chapter 8).

    ``vllm_executable`` is where vLLM's console script is installed (a virtual environment
    under /opt here; systemd wants an absolute path). The API key is ``VLLM_API_KEY=...`` in
    ``environment_file`` (default ``/etc/vllm/<name>.env``, mode 0600, root-owned: systemd
    reads it before dropping privileges). No root: ``DynamicUser=yes`` runs the server as a
    throwaway user, and ``CacheDirectory=vllm`` gives that user ``/var/cache/vllm`` for the
    Hugging Face cache (``HF_HOME``), kept across restarts. ``Restart=on-failure`` restarts a
    crashed server after ``RestartSec``; ``TimeoutStopSec`` gives it time to finish in-flight
    requests before SIGKILL. Options from systemd.exec(5), systemd.service(5) (systemd 252).
    """
    if not vllm_executable.startswith("/"):
        raise ParameterError("vllm_executable", f"vllm_executable must be an absolute path, "
                                                f"got {vllm_executable!r}")
    env_file = environment_file or f"/etc/vllm/{spec.object_name}.env"
    command = [vllm_executable, *vllm_serve_command(spec)[1:]]
    exec_start = " ".join(shlex.quote(arg) for arg in command)
    return f"""[Unit]
Description=vLLM serving {spec.served_name} on {spec.host}:{spec.port} (labkit.deploy, chapter 8)
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
ExecStart={exec_start}
EnvironmentFile={env_file}
Environment=HF_HOME=/var/cache/vllm
DynamicUser=yes
CacheDirectory=vllm
NoNewPrivileges=yes
PrivateTmp=yes
Restart=on-failure
RestartSec=10
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
"""


def docker_run(spec: DeploymentSpec) -> list[str]:
    """``docker run`` for ``spec`` (chapter 8), as an argument list.

    The image's ENTRYPOINT is ``vllm serve``, so the arguments after the image are
    :func:`vllm_serve_command`'s after ``vllm serve``, listening on ``0.0.0.0`` inside the
    container (Docker forwards to the container's interface) while ``-p`` publishes the port
    on the host's 127.0.0.1 only. ``--cpus`` and ``--memory`` are the spec's limits;
    ``--gpus N`` hands over N GPUs; ``--shm-size`` gives PyTorch's inter-process tensors room
    in /dev/shm without sharing the host's IPC namespace (vLLM's docs allow either this or
    ``--ipc=host``, docs/deployment/docker.md); the model cache is the host directory
    ``host_cache_dir``; ``--env VLLM_API_KEY`` passes the key from the calling shell's
    environment without writing it on the line.
    """
    command = vllm_serve_command(spec, host="0.0.0.0")
    return ["docker", "run", "--rm", "--name", spec.object_name,
            "--gpus", str(spec.gpus),
            f"--cpus={spec.cpu}", f"--memory={spec.memory_gib}g",
            f"--shm-size={spec.shm_gib}g",
            "-p", f"127.0.0.1:{spec.port}:{spec.port}",
            "-v", f"{spec.host_cache_dir}:{CONTAINER_CACHE}",
            "--env", API_KEY_ENV,
            spec.image, *command[2:]]

