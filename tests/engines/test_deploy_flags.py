"""labkit.deploy's commands judged by vLLM's own argument parser (chapter 8), and the
tutorial's chapter 8 script judged the same way.

Run by ``make test-engines`` in its own environment (vLLM installed without its heavy
dependencies); the parser is built as in test_engine_flags.py.
"""

import os

import pytest
from test_engine_flags import vllm_parser

from labkit.deploy import DeploymentSpec, docker_run, helm_values, vllm_serve_command
from labkit.tutorial.ch08_deploy import TUTORIAL_SERVER_ARGS, TUTORIAL_SCRIPT_PROBLEMS

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SPECS = [
    DeploymentSpec(model="hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
                   served_model_name="llama-70b",
                   tensor_parallel_size=4, max_model_len=8192, quantization="awq",
                   max_num_seqs=64),
    DeploymentSpec(model="Qwen/Qwen2.5-7B-Instruct", name="qwen", dtype="bfloat16", port=8080,
                   quantization="fp8", gpu_memory_utilization=0.85),
]


def parse(args):
    """vLLM's namespace for ``vllm serve`` arguments (the model passed as ``--model``)."""
    return vllm_parser().parse_args(["--model", args[0], *args[1:]])


@pytest.mark.parametrize("spec", SPECS)
def test_vllm_parses_the_deployment_command(spec):
    command = vllm_serve_command(spec)
    assert command[:2] == ["vllm", "serve"]
    args = parse(command[2:])
    assert (args.model, args.served_model_name) == (spec.model, [spec.served_name])
    assert (args.host, args.port) == (spec.host, spec.port)
    assert args.tensor_parallel_size == spec.tensor_parallel_size
    assert args.gpu_memory_utilization == spec.gpu_memory_utilization
    assert (args.max_model_len, args.max_num_seqs) == (spec.max_model_len, spec.max_num_seqs)
    assert (args.quantization, args.dtype) == (spec.quantization, spec.dtype)
    # Safe by default: no remote code, CUDA graphs on.
    assert args.trust_remote_code is False and args.enforce_eager is False


@pytest.mark.parametrize("spec", SPECS)
def test_vllm_parses_the_docker_arguments(spec):
    line = docker_run(spec)
    args = parse(line[line.index(spec.image) + 1:])  # the image's ENTRYPOINT is `vllm serve`
    assert (args.model, args.host, args.port) == (spec.model, "0.0.0.0", spec.port)


@pytest.mark.parametrize("spec", SPECS)
def test_vllm_parses_the_helm_extra_args(spec):
    extra = helm_values(spec)["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArgs"]
    args = parse([spec.model, *extra])
    assert args.served_model_name == [spec.served_name]
    assert args.quantization == spec.quantization


#: The tutorial's flags that vLLM no longer has, and how many values each takes.
# Flags the pinned vLLM (the Makefile's VLLM_VERSION, 0.33.0) rejects, and how many values each
# takes. (0.32.0 rejected --disable-log-requests too; 0.33.0 accepts it again.)
REMOVED = {"--swap-space": 1}


def drop(args, flag, values):
    at = args.index(flag)
    return args[:at] + args[at + 1 + values:]


def test_the_tutorials_script_is_rejected_by_vllm():
    tutorial = list(TUTORIAL_SERVER_ARGS[1:])  # [0] is "--model": parse() adds it back
    with pytest.raises(SystemExit):
        parse(tutorial)
    for flag in REMOVED:  # each one alone is enough to fail
        alone = tutorial
        for other, values in REMOVED.items():
            if other != flag:
                alone = drop(alone, other, values)
        with pytest.raises(SystemExit):
            parse(alone)
        assert flag in TUTORIAL_SCRIPT_PROBLEMS
    rest = tutorial
    for flag, values in REMOVED.items():
        rest = drop(rest, flag, values)
    args = parse(rest)  # without them the line parses, and is still unsafe
    assert args.trust_remote_code and args.enforce_eager
    assert args.enable_log_requests is False  # --disable-log-requests: the default anyway
    assert {"--trust-remote-code", "--enforce-eager"} <= set(TUTORIAL_SCRIPT_PROBLEMS)
