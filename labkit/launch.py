"""Launch real inference engines: one config, four command lines
(:ref:`ch02-vllm`, :ref:`ch02-sglang`, :ref:`ch02-tensorrt-llm`).

``ServeConfig`` holds the deployment options the tutorial uses (tensor parallelism, memory
fraction, context length, quantization, served name) with safe defaults: bind to localhost,
never ``--trust-remote-code`` unless asked. It renders to ``vllm serve``, SGLang's
``launch_server``, TensorRT-LLM's ``trtllm-serve`` (and the older convert/build steps), and
``labkit serve``, the teaching engine that stands in on machines without a GPU.

This module only writes command lines. :class:`labkit.process.ServerProcess` runs one, and
:mod:`labkit.harness.lab_engines` picks the engine a lab runs on this machine and starts it.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.speculative import SpeculativeConfig
from labkit.lab import shown_path


@dataclass(frozen=True)
class ServeConfig:
    """What to serve and how; option names are vLLM's."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    quantization: str | None = None
    dtype: str = "auto"
    max_num_seqs: int | None = None
    trust_remote_code: bool = False
    shutdown_timeout: int | None = None  # s to drain running requests on SIGTERM (vLLM: 0)
    # vLLM's --speculative-config, a JSON object by its key names (chapter 9)
    speculative_config: Mapping[str, object] | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model:
            raise ParameterError("model", f"model must be a model name or directory, "
                                          f"got {self.model!r}")
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        in_range("port", self.port, 1, 65535)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        if self.shutdown_timeout is not None:
            positive_int("shutdown_timeout", self.shutdown_timeout, at_least=0)
        if self.speculative_config is not None:
            _check_speculative_config(self.speculative_config)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


def _check_speculative_config(config: object) -> None:
    """vLLM's own checks that do not depend on the method: a JSON object whose
    ``num_speculative_tokens``, when given, is a whole number of drafts, at least 1."""
    if not isinstance(config, Mapping):
        raise ParameterError("speculative_config", f"speculative_config must be a mapping of "
                             f"vLLM's --speculative-config keys, got {type(config).__name__}")
    try:
        json.dumps(dict(config), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ParameterError("speculative_config", f"speculative_config must be JSON: "
                                                   f"{err}") from None
    drafts = config.get("num_speculative_tokens")
    if drafts is not None:
        if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1:
            raise ParameterError("speculative_config", f"speculative_config: "
                                 f"num_speculative_tokens must be an integer >= 1, "
                                 f"got {drafts!r}")


def _optional(flag: str, value) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _speculative(cfg: ServeConfig) -> list[str]:
    """``--speculative-config`` as vLLM and ``labkit serve`` read it: compact JSON."""
    if cfg.speculative_config is None:
        return []
    return ["--speculative-config", json.dumps(dict(cfg.speculative_config),
                                               separators=(",", ":"), allow_nan=False)]


def _no_speculative(cfg: ServeConfig, engine: str, flags: str) -> None:
    """Refuse vLLM's ``--speculative-config`` for an engine that names speculation otherwise:
    its methods and counts do not map one to one, so a translation would change what runs."""
    if cfg.speculative_config is not None:
        raise ParameterError("speculative_config", f"speculative_config is vLLM's "
                             f"--speculative-config; {engine} has its own flags with other "
                             f"meanings ({flags}): pass them in extra_args")


def vllm_command(cfg: ServeConfig) -> list[str]:
    """``vllm serve`` with the config's options (vLLM's OpenAI-compatible server)."""
    return ["vllm", "serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
            "--served-model-name", cfg.name,
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            "--dtype", cfg.dtype,
            *_optional("--max-model-len", cfg.max_model_len),
            *_optional("--quantization", cfg.quantization),
            *_optional("--max-num-seqs", cfg.max_num_seqs),
            *_optional("--shutdown-timeout", cfg.shutdown_timeout),
            *_speculative(cfg),
            *(["--trust-remote-code"] if cfg.trust_remote_code else []),
            *cfg.extra_args]


def sglang_command(cfg: ServeConfig) -> list[str]:
    """``python -m sglang.launch_server``: SGLang names the same options differently."""
    _no_speculative(cfg, "SGLang", "--speculative-algorithm NGRAM or EAGLE, "
                                   "--speculative-num-draft-tokens, ...")
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model,
            "--host", cfg.host, "--port", str(cfg.port), "--served-model-name", cfg.name,
            "--tp-size", str(cfg.tensor_parallel_size),
            "--mem-fraction-static", str(cfg.gpu_memory_utilization),
            "--dtype", cfg.dtype,
            *_optional("--context-length", cfg.max_model_len),
            *_optional("--quantization", cfg.quantization),
            *_optional("--max-running-requests", cfg.max_num_seqs),
            *(["--trust-remote-code"] if cfg.trust_remote_code else []),
            *cfg.extra_args]


def trtllm_kv_fraction(gpu_memory_utilization: float, gpu_memory_bytes: float,
                       weights_bytes: float, activation_bytes: float = 0.0) -> float:
    """TensorRT-LLM's ``--kv_cache_free_gpu_memory_fraction`` that gives the KV cache the bytes
    vLLM's ``--gpu-memory-utilization`` would (:ref:`ch02-sglang`).

    vLLM caps the whole instance at ``u * total``: the KV cache gets ``u*T - W - A`` (weights,
    activation peak). TensorRT-LLM measures what is free after loading the weights and a
    profiling forward, ``T - W - A``, and gives the KV cache the fraction ``f`` of it. Equal
    caches need ``f = (u*T - W - A) / (T - W - A)``: copying ``u`` into ``f`` gives more.
    """
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    in_range("gpu_memory_bytes", gpu_memory_bytes, 0, low_open=True)
    in_range("weights_bytes", weights_bytes, 0)
    in_range("activation_bytes", activation_bytes, 0)
    used = weights_bytes + activation_bytes
    budget = gpu_memory_utilization * gpu_memory_bytes
    if budget <= used:
        raise ParameterError("gpu_memory_utilization",
                             f"gpu_memory_utilization {gpu_memory_utilization} leaves no KV "
                             f"cache: {budget / 2**30:.1f} GiB budget <= {used / 2**30:.1f} GiB "
                             "of weights and activations")
    return (budget - used) / (gpu_memory_bytes - used)


def trtllm_command(cfg: ServeConfig, backend: str = "pytorch", *,
                   kv_cache_free_gpu_memory_fraction: float | None = None) -> list[str]:
    """``trtllm-serve``: TensorRT-LLM's OpenAI-compatible server.

    ``backend="pytorch"`` serves a Hugging Face checkpoint with no build step;
    ``"tensorrt"`` serves an engine directory made by ``trtllm-build``. Its KV-cache knob is
    the fraction of memory left *after* the weights, not of the whole GPU, so it is not
    ``cfg.gpu_memory_utilization``: pass the value :func:`trtllm_kv_fraction` derives, or
    leave it out and TensorRT-LLM keeps its own default (0.9 of the free memory).
    """
    if backend not in ("pytorch", "tensorrt"):
        raise ParameterError("backend", f"backend must be 'pytorch' or 'tensorrt', "
                                        f"got {backend!r}")
    _no_speculative(cfg, "trtllm-serve", "speculative_config in its --extra_llm_api_options "
                                         "YAML file")
    if kv_cache_free_gpu_memory_fraction is not None:
        in_range("kv_cache_free_gpu_memory_fraction", kv_cache_free_gpu_memory_fraction, 0, 1,
                 low_open=True)
    return ["trtllm-serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
            "--backend", backend, "--tp_size", str(cfg.tensor_parallel_size),
            *_optional("--kv_cache_free_gpu_memory_fraction", kv_cache_free_gpu_memory_fraction),
            *_optional("--max_seq_len", cfg.max_model_len),
            *_optional("--max_batch_size", cfg.max_num_seqs),
            *(["--trust_remote_code"] if cfg.trust_remote_code else []),
            *cfg.extra_args]


def trtllm_build_commands(cfg: ServeConfig, checkpoint_dir: str, engine_dir: str,
                          max_batch_size: int = 64, max_input_len: int = 4096,
                          dtype: str = "float16") -> list[list[str]]:
    """The ahead-of-time path the tutorial shows: convert the checkpoint, then build engines.

    ``convert_checkpoint.py`` ships per model family in TensorRT-LLM's ``examples/`` folder.
    """
    max_seq_len = cfg.max_model_len or 8192
    return [
        ["python", "convert_checkpoint.py", "--model_dir", cfg.model,
         "--output_dir", checkpoint_dir, "--dtype", dtype,
         "--tp_size", str(cfg.tensor_parallel_size)],
        ["trtllm-build", "--checkpoint_dir", checkpoint_dir, "--output_dir", engine_dir,
         "--gemm_plugin", "auto", "--max_batch_size", str(max_batch_size),
         "--max_input_len", str(max_input_len), "--max_seq_len", str(max_seq_len)],
    ]


def labkit_command(cfg: ServeConfig) -> list[str]:
    """``labkit serve``, the teaching engine, with vLLM's flag names."""
    if cfg.tensor_parallel_size != 1:
        raise ParameterError("tensor_parallel_size", "tensor_parallel_size must be 1 for the "
                             "teaching engine: it runs on one device, unquantized, got "
                             f"{cfg.tensor_parallel_size}")
    if cfg.quantization:
        raise ParameterError("quantization", "quantization must be None for the teaching "
                             "engine: it runs on one device, unquantized, got "
                             f"{cfg.quantization!r}")
    if cfg.speculative_config is not None:  # what it does not implement, refused here
        SpeculativeConfig.from_dict(cfg.speculative_config)
    return [sys.executable, "-m", "labkit.cli", "serve", cfg.model, "--host", cfg.host,
            "--port", str(cfg.port), "--served-model-name", cfg.name,
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            *_optional("--max-model-len", cfg.max_model_len),
            *_optional("--max-num-seqs", cfg.max_num_seqs), *_speculative(cfg),
            *cfg.extra_args]


def format_command(command: Sequence[str]) -> str:
    """A command as a shell line continued over several lines, one ``--flag value`` per line,
    to read: this machine's paths are shown from the checkout or from ``~``
    (:func:`labkit.lab.shown_path`)."""
    lines, current = [], [_quoted(command[0])]
    for arg in command[1:]:
        if arg.startswith("--"):
            lines.append(" ".join(current))
            current = []
        current.append(_quoted(arg))
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


def _quoted(arg: str) -> str:
    """One argument for a shell, machine paths shown as :func:`~labkit.lab.shown_path` does;
    ``~/`` stays outside the quotes, so that the shell still expands it."""
    shown = shown_path(arg)
    if shown.startswith("~/"):
        return "~/" + shlex.quote(shown[2:])
    return shlex.quote(shown)


#: Every engine labkit launches, by the name used across labkit, and its command line.
COMMANDS = {"vllm": vllm_command, "sglang": sglang_command, "trtllm": trtllm_command,
            "labkit": labkit_command}


def command_for(engine: str, cfg: ServeConfig) -> list[str]:
    """The command line that serves ``cfg`` with ``engine``, a name in :data:`COMMANDS`
    (:ref:`ch02-vllm`)."""
    if engine not in COMMANDS:
        raise ParameterError("engine", f"engine must be one of {tuple(COMMANDS)}, "
                                       f"got {engine!r}")
    return COMMANDS[engine](cfg)


def multi_node_commands(cfg: ServeConfig, pipeline_parallel_size: int,
                        head_address: str = "HEAD_IP",
                        ray_port: int = 6379) -> dict[str, list[str]]:
    """vLLM across nodes (:ref:`ch03-tensor-parallelism`): a Ray cluster, then ``vllm serve`` on the
    head node with tensor parallelism inside each node (``cfg.tensor_parallel_size``) and pipeline
    parallelism across ``pipeline_parallel_size`` nodes."""
    positive_int("pipeline_parallel_size", pipeline_parallel_size)
    serve = replace(cfg, extra_args=(*cfg.extra_args,
                                     "--pipeline-parallel-size", str(pipeline_parallel_size),
                                     "--distributed-executor-backend", "ray"))
    return {"head node": ["ray", "start", "--head", "--port", str(ray_port)],
            "every other node": ["ray", "start", f"--address={head_address}:{ray_port}"],
            "then, on the head node": vllm_command(serve)}
