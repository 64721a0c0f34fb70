"""``labkit serve``'s command line: vLLM's flag names for the teaching engine
(:ref:`ch02-flags`, :ref:`ch02-streaming`).

One parser for two readers: the CLI (``labkit.cli``) adds it as its ``serve`` subcommand,
and the chapter 2 lab harness reads with it the :class:`~labkit.engine.EngineArgs` that a
``labkit serve`` command line gives, so a prediction of the server's KV cache starts from the
very flags the server parsed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from labkit.engine.device import DEVICE_ID_ENV
from labkit.engine.llm_engine import EngineArgs


def serve_parser(subparsers) -> argparse.ArgumentParser:
    """``labkit serve``: vLLM's flag names, defaults from :class:`~labkit.engine.EngineArgs`
    (chapter 2)."""
    defaults = EngineArgs(model="")
    p = subparsers.add_parser("serve", help="serve a model directory over the OpenAI API")
    p.add_argument("model", help="Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the directory given)")
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=defaults.gpu_memory_utilization)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_prefix_caching)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_chunked_prefill)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--device-memory-gib", type=float, default=defaults.device_memory_gib,
                   help="memory of the simulated device the KV cache is sized against")
    p.add_argument("--device-id", default=os.environ.get(DEVICE_ID_ENV),
                   help="share a simulated device with the other servers that name it: each "
                        "sees the others' memory as used (default: $LABKIT_DEVICE_ID; none: "
                        "a device of its own)")
    p.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_sleep_mode,
                   help="allow POST /sleep and /wake_up (routes on with "
                        "VLLM_SERVER_DEV_MODE=1, as in vLLM)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative decoding config; the teaching engine implements "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                        "\"prompt_lookup_min\": N, \"prompt_lookup_max\": N}' and "
                        "'{\"method\": \"draft_model\", \"model\": DIR, "
                        "\"num_speculative_tokens\": K}', and refuses any other key")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $VLLM_API_KEY, as vLLM)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse request bodies larger than this with HTTP 413 "
                        "(default: 4 MiB)")
    p.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection that has not sent a whole request's headers this "
                        "long after it opened or after its last response (default 60, as "
                        "nginx's client_header_timeout)")
    return p


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine's share of ``labkit serve``'s parsed flags (the rest configure HTTP)."""
    return EngineArgs(model=ns.model, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      block_size=ns.block_size, gpu_memory_utilization=ns.gpu_memory_utilization,
                      max_model_len=ns.max_model_len,
                      enable_prefix_caching=ns.enable_prefix_caching,
                      enable_chunked_prefill=ns.enable_chunked_prefill, seed=ns.seed,
                      device_memory_gib=ns.device_memory_gib, device_id=ns.device_id,
                      enable_sleep_mode=ns.enable_sleep_mode,
                      speculative_config=ns.speculative_config)


def parse_engine_args(argv: Sequence[str]) -> EngineArgs:
    """The :class:`~labkit.engine.EngineArgs` of ``labkit serve ARGV...`` (``argv``: the model
    directory, then vLLM-style flags), read by the server's own parser (chapter 2)."""
    parser = argparse.ArgumentParser(prog="labkit")
    serve_parser(parser.add_subparsers(dest="command"))
    return engine_args(parser.parse_args(["serve", *argv]))
