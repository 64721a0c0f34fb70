"""The launch commands labkit renders, parsed by vLLM's and SGLang's own argument parsers.

Run by ``make test-engines`` in a separate environment with the engines installed (heavy, so
it stays out of the main ``make test``; CI runs both).
"""

import argparse
import os

import pytest

from labkit.launch import ServeConfig, sglang_command, vllm_command

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

CONFIGS = [
    ServeConfig(model="meta-llama/Meta-Llama-3-70B-Instruct", served_model_name="llama-70b",
                tensor_parallel_size=4, gpu_memory_utilization=0.9, max_model_len=8192,
                quantization="awq", max_num_seqs=128),
    ServeConfig(model="Qwen/Qwen2.5-7B-Instruct", port=8123, dtype="bfloat16",
                trust_remote_code=True, quantization="fp8"),
    ServeConfig(model="/models/tiny", host="0.0.0.0", gpu_memory_utilization=0.5),
]


def vllm_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("cfg", CONFIGS)
def test_vllm_parses_our_command(cfg):
    command = vllm_command(cfg)
    assert command[:2] == ["vllm", "serve"]
    args = vllm_parser().parse_args(["--model", command[2], *command[3:]])
    assert args.model == cfg.model
    assert args.tensor_parallel_size == cfg.tensor_parallel_size
    assert args.gpu_memory_utilization == cfg.gpu_memory_utilization
    assert args.max_model_len == cfg.max_model_len
    assert args.quantization == cfg.quantization
    assert args.served_model_name == [cfg.name]
    assert (args.host, args.port) == (cfg.host, cfg.port)
    assert args.trust_remote_code == cfg.trust_remote_code
    if cfg.max_num_seqs:
        assert args.max_num_seqs == cfg.max_num_seqs


@pytest.mark.parametrize("cfg", CONFIGS)
def test_sglang_parses_our_command(cfg):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    command = sglang_command(cfg)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    args = parser.parse_args(command[3:])
    assert args.model_path == cfg.model
    assert args.tp_size == cfg.tensor_parallel_size
    assert args.mem_fraction_static == cfg.gpu_memory_utilization
    assert args.context_length == cfg.max_model_len
    assert args.quantization == cfg.quantization
    assert args.served_model_name == cfg.name
    assert (args.host, args.port) == (cfg.host, cfg.port)
    assert args.trust_remote_code == cfg.trust_remote_code


def test_vllm_parses_our_speculative_config():
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    command = vllm_command(ServeConfig(model="/models/tiny", speculative_config=ngram))
    args = vllm_parser().parse_args(["--model", command[2], *command[3:]])
    assert args.speculative_config == ngram
