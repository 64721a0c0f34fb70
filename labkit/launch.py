"""Launch real inference engines: one config, four command lines
(:ref:`ch02-vllm`, :ref:`ch02-sglang`, :ref:`ch02-tensorrt-llm`).

``ServeConfig`` holds the deployment options the tutorial uses (tensor parallelism, memory
fraction, context length, quantization, served name) with safe defaults: bind to localhost,
never ``--trust-remote-code`` unless asked. It renders to ``vllm serve``, SGLang's
``launch_server``, TensorRT-LLM's ``trtllm-serve`` (and the older convert/build steps), and
``labkit serve``, the teaching engine that stands in on machines without a GPU.
``ServerProcess`` starts any of them, waits for ``/health`` and stops the whole process group.
"""

from __future__ import annotations

import csv
import re
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources

import httpx

from labkit.checks import in_range, positive_int
from labkit.lab import LabPath, detect
from labkit.units import cdiv


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
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a model name or directory")
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        in_range("port", self.port, 1, 65535)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        if self.shutdown_timeout is not None:
            positive_int("shutdown_timeout", self.shutdown_timeout, at_least=0)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _optional(flag: str, value) -> list[str]:
    return [] if value is None else [flag, str(value)]


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
            *(["--trust-remote-code"] if cfg.trust_remote_code else []),
            *cfg.extra_args]


def sglang_command(cfg: ServeConfig) -> list[str]:
    """``python -m sglang.launch_server``: SGLang names the same options differently."""
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
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} leaves no KV cache: "
                         f"{budget / 2**30:.1f} GiB budget <= {used / 2**30:.1f} GiB of weights "
                         "and activations")
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
        raise ValueError(f"backend must be 'pytorch' or 'tensorrt', got {backend!r}")
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
    if cfg.tensor_parallel_size != 1 or cfg.quantization:
        raise ValueError("the teaching engine runs on one device, unquantized")
    return [sys.executable, "-m", "labkit.cli", "serve", cfg.model, "--host", cfg.host,
            "--port", str(cfg.port), "--served-model-name", cfg.name,
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            *_optional("--max-model-len", cfg.max_model_len),
            *_optional("--max-num-seqs", cfg.max_num_seqs), *cfg.extra_args]


def format_command(command: Sequence[str]) -> str:
    """A command as a shell line continued over several lines, one ``--flag value`` per line."""
    lines, current = [], [shlex.quote(command[0])]
    for arg in command[1:]:
        if arg.startswith("--"):
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(arg))
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


#: Every engine labkit launches, by the name used across labkit, and its command line.
COMMANDS = {"vllm": vllm_command, "sglang": sglang_command, "trtllm": trtllm_command,
            "labkit": labkit_command}


def command_for(engine: str, cfg: ServeConfig) -> list[str]:
    """The command line that serves ``cfg`` with ``engine``, a name in :data:`COMMANDS`
    (:ref:`ch02-vllm`)."""
    if engine not in COMMANDS:
        raise ValueError(f"engine must be one of {tuple(COMMANDS)}, got {engine!r}")
    return COMMANDS[engine](cfg)


def choose_engine(wanted: str, path: LabPath | None = None) -> str:
    """``wanted`` when this machine can run it (on a GPU, or vLLM's CPU build), else
    ``labkit``, the teaching engine."""
    path = path or detect()
    return wanted if wanted == "labkit" or path.runs(wanted) != "teaching" else "labkit"


class ServerProcess:
    """A server subprocess: started in its own process group, healthy, then stopped whole.

        with ServerProcess(command_for("labkit", cfg), cfg.base_url) as server:
            ...  # server.base_url answers OpenAI requests

    ``env`` adds variables to the server's environment (vLLM on CPU reads its KV-cache size
    from one). :meth:`attach` wraps a server that somebody else started and will stop.
    """

    def __init__(self, command: Sequence[str], base_url: str, startup_timeout_s: float = 600,
                 env: Mapping[str, str] | None = None):
        self.command, self.base_url = list(command), base_url
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.owned = True
        with tempfile.NamedTemporaryFile("w", prefix="server-", suffix=".log",
                                         delete=False) as log:
            self.log_path = log.name

    @classmethod
    def attach(cls, base_url: str, log_path: str | None = None) -> ServerProcess:
        """A healthy server started elsewhere (one vLLM shared by every lab of a test run):
        :meth:`stop` leaves it running."""
        server = cls([], base_url)
        server.owned = False
        if log_path is not None:
            os.unlink(server.log_path)
            server.log_path = log_path
        if httpx.get(base_url + "/health", timeout=5).status_code != 200:
            raise RuntimeError(f"the server at {base_url} is not healthy")
        return server

    def start(self) -> ServerProcess:
        """Start the server and wait for its ``/health``; a server already running is kept
        (``with`` on a started server does not start a second one)."""
        if self.process is not None and self.process.poll() is None:
            return self
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=parent_death_hook(),
                                            env={**os.environ, **self.env})
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with code {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout_s} s:\n"
                           f"{self.log_tail()}")

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM the whole process group (engines spawn workers), SIGKILL after grace."""
        if not self.owned or self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait()

    def log_lines(self) -> list[str]:
        with open(self.log_path, errors="replace") as f:
            return f.readlines()

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log_lines()[-lines:])

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parent_death_hook() -> Callable[[], None] | None:
    """``preexec_fn`` for a server started from this thread: :func:`die_with_parent` on the
    main thread, none elsewhere. Linux sends the parent-death signal when the *thread* that
    forked the child exits, so a server started from a worker thread (``asyncio.to_thread``,
    a thread pool) would die with that thread; such servers are stopped by their owners."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def die_with_parent() -> None:
    """In the child, before the server starts: on Linux, ask for SIGTERM when the process that
    started it dies, so a killed notebook kernel or test run leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


#: The model GPU-path labs serve unless ``LABKIT_GPU_MODEL`` names another.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def lab_model(engine: str, path: LabPath | None = None) -> str:
    """The model a lab serves: a real one on the GPU path, the tiny local one on the CPU paths
    (real vLLM on CPU serves it too: nothing is downloaded).

    The tiny model is written once to ``$LABKIT_CACHE`` (default ``~/.cache/labkit``).
    """
    if (path or detect()).runs(engine) == "gpu":
        return os.environ.get("LABKIT_GPU_MODEL", DEFAULT_GPU_MODEL)
    from pathlib import Path

    from labkit.engine.tiny import write_tiny_model

    cache = Path(os.environ.get("LABKIT_CACHE", Path.home() / ".cache" / "labkit"))
    target = cache / "tiny-llama"
    if not (target / "model.safetensors").is_file():
        write_tiny_model(target)
    return str(target)


def offline_api(engine: str, path: LabPath | None = None):
    """``(LLM, SamplingParams)`` for a lab about ``engine``'s offline API on this machine.

    vLLM's own classes on the GPU path; on the vLLM-on-CPU path an ``LLM`` that runs vLLM in
    its environment (:class:`labkit.vllm_cpu.RemoteLLM`) with the teaching engine's
    ``SamplingParams``; the teaching engine's pair otherwise.
    """
    from functools import partial

    from labkit.engine import LLM, SamplingParams

    path = path or detect()
    runs = path.runs(engine)
    if engine not in ("vllm", "labkit"):
        raise ValueError(f"engine must be 'vllm' or 'labkit' for the offline API, got {engine!r}")
    if engine == "vllm" and runs == "gpu":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLM, VLLMSamplingParams
    if engine == "vllm" and runs == "cpu":
        from labkit.vllm_cpu import RemoteLLM

        return partial(RemoteLLM, path.vllm_cpu_python), SamplingParams
    return LLM, SamplingParams


#: Environment variables of a vLLM server on CPU that every lab of a test run shares (startup
#: takes a minute): its URL and its log. Set by the test suite; labs asking for the default
#: server attach to it instead of starting their own.
SHARED_VLLM_URL, SHARED_VLLM_LOG = "LABKIT_VLLM_URL", "LABKIT_VLLM_LOG"


#: The server a lab starts unless it asks for other options.
LAB_SERVER_DEFAULTS = {"served_model_name": "course-model", "max_model_len": 1024}


def start_lab_server(wanted: str, path: LabPath | None = None,
                     **options) -> tuple[str, ServeConfig, ServerProcess]:
    """Start the server a lab is about: ``wanted`` on its GPU path, real vLLM on CPU when
    that is installed, the teaching engine (``labkit``) otherwise.

    ``options`` are :class:`ServeConfig` fields (vLLM's names: ``max_num_seqs``,
    ``tensor_parallel_size``, ``extra_args=["--no-enable-prefix-caching"]``, ...) on top of
    :data:`LAB_SERVER_DEFAULTS`. Returns the engine that runs, its config and the started
    :class:`ServerProcess`, which the lab stops when done. With no options, vLLM on CPU is
    the test run's shared server when there is one (``LABKIT_VLLM_URL``).
    """
    path = path or detect()
    engine = choose_engine(wanted, path)
    cfg = ServeConfig(model=lab_model(engine, path), port=free_port(),
                      **{**LAB_SERVER_DEFAULTS, **options})
    shared = os.environ.get(SHARED_VLLM_URL)
    if engine == "vllm" and path.runs("vllm") == "cpu" and shared and not options:
        cfg = replace(cfg, port=int(shared.rsplit(":", 1)[1]))
        return engine, cfg, ServerProcess.attach(shared, os.environ.get(SHARED_VLLM_LOG))
    return engine, cfg, start_server(engine, cfg, path)


def engine_table_markdown(columns: Sequence[str] = ("kv_cache", "prefix_cache", "batching",
                                                      "structured_output", "quantization",
                                                      "hardware", "server")) -> str:
    """The framework comparison of chapter 2 from ``labkit/data/engines.csv`` (sourced rows)."""
    text = resources.files("labkit.data").joinpath("engines.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    header = "| | " + " | ".join(row["engine"] for row in rows) + " |"
    lines = [header, "|---" * (len(rows) + 1) + "|"]
    for column in columns:
        cells = " | ".join(row[column] for row in rows)
        lines.append(f"| {column.replace('_', ' ')} | {cells} |")
    return "\n".join(lines)


def flag_table_markdown(cfg: ServeConfig) -> str:
    """The same deployment options as each engine spells them, rendered from ``cfg``."""
    rendered = {name: command_for(name, cfg) for name in ("vllm", "sglang", "trtllm")}
    options = [("tensor parallelism", "--tensor-parallel-size", "--tp-size", "--tp_size"),
               ("memory for the KV cache", "--gpu-memory-utilization", "--mem-fraction-static",
                "--kv_cache_free_gpu_memory_fraction"),
               ("context length", "--max-model-len", "--context-length", "--max_seq_len"),
               ("concurrent sequences", "--max-num-seqs", "--max-running-requests",
                "--max_batch_size")]
    lines = ["| option | vLLM | SGLang | TensorRT-LLM |", "|---|---|---|---|"]
    for label, *flags in options:
        cells = []
        for engine, flag in zip(rendered, flags, strict=True):
            cmd = rendered[engine]
            value = cmd[cmd.index(flag) + 1] if flag in cmd else "(default)"
            cells.append(f"`{flag} {value}`" if flag in cmd else f"`{flag}` {value}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the server a lab runs, as this machine runs it (chapter 2, three paths) -----------------

def lab_server_command(engine: str, cfg: ServeConfig, path: LabPath | None = None) -> list[str]:
    """The command that serves ``cfg`` with ``engine`` here: :func:`command_for`'s, except
    that vLLM's CPU build starts as ``python -m vllm.entrypoints.openai.api_server``."""
    path = path or detect()
    if engine == "vllm" and path.runs("vllm") == "cpu":
        from labkit import vllm_cpu

        return vllm_cpu.server_command(path.vllm_cpu_python, vllm_command(cfg))
    return command_for(engine, cfg)


def lab_server_env(engine: str, cfg: ServeConfig, path: LabPath | None = None) -> dict[str, str]:
    """Environment variables the server of ``cfg`` needs here: for vLLM a plain log (Jupyter
    kernels set ``FORCE_COLOR``, which vLLM honours even in a file); on its CPU build also the
    KV cache's host memory and, with several ranks, the cores of each rank."""
    path = path or detect()
    if engine != "vllm":
        return {}
    env = {"VLLM_LOGGING_COLOR": "0"}
    if path.runs("vllm") == "cpu":
        from labkit import vllm_cpu

        env |= {**vllm_cpu.cpu_env(), **vllm_cpu.parallel_env(cfg.tensor_parallel_size)}
    return env


def start_server(engine: str, cfg: ServeConfig, path: LabPath | None = None,
                 startup_timeout_s: float = 600) -> ServerProcess:
    """Start ``cfg`` (any model, any options) on ``engine`` as this machine runs it and wait
    until it is healthy: :func:`lab_server_command` with :func:`lab_server_env`."""
    return ServerProcess(lab_server_command(engine, cfg, path), cfg.base_url, startup_timeout_s,
                         env=lab_server_env(engine, cfg, path)).start()


def served_model_spec(cfg: ServeConfig):
    """The :class:`~labkit.hardware.ModelSpec` of the model ``cfg`` serves: from its directory,
    or from the Hugging Face cache for a repository name (the GPU path downloads it there)."""
    from pathlib import Path

    from labkit.hardware import ModelSpec

    if Path(cfg.model).is_dir():
        return ModelSpec.from_hf_config(cfg.model)
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(cfg.model, "config.json")
    if not isinstance(config, str):
        raise ValueError(f"model: no config.json for {cfg.model!r} in the Hugging Face cache")
    return ModelSpec.from_hf_config(config, name=cfg.model)


@dataclass(frozen=True)
class KVCacheReport:
    """A KV-cache size in vLLM's terms, as an engine reported it or as chapter 1's rule
    predicts it: tokens, and how many ``max_model_len`` requests fit."""

    tokens: int
    max_concurrency: float
    source: str

    def __str__(self) -> str:
        return (f"{self.tokens:,} tokens, maximum concurrency {self.max_concurrency:,.2f}x "
                f"({self.source})")


_KV_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                      r"([\d,]+) tokens per request: ([\d.,]+)x")


def read_kv_cache_line(lines: Sequence[str]) -> KVCacheReport | None:
    """vLLM's startup line "GPU (or CPU) KV cache size: N tokens, Maximum concurrency for L
    tokens per request: Cx" from its log, the last one if several; None if absent."""
    for line in reversed(lines):
        match = _KV_LINE.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if match:
            return KVCacheReport(int(match[2].replace(",", "")),
                                 float(match[4].replace(",", "")), match[0])
    return None


def _teaching_engine_args(cfg: ServeConfig):
    """The :class:`~labkit.engine.EngineArgs` that ``labkit serve`` builds from ``cfg``'s
    command line, parsed by its own parser."""
    import argparse

    from labkit.cli import engine_args, serve_parser

    parser = argparse.ArgumentParser(prog="labkit")
    serve_parser(parser.add_subparsers(dest="command"))
    return engine_args(parser.parse_args(labkit_command(cfg)[3:]))


def kv_cache_reported(engine: str, cfg: ServeConfig, server: ServerProcess) -> KVCacheReport:
    """The KV cache the running server reports: vLLM's startup log line (GPU or CPU build);
    for the teaching engine, the blocks its engine allocates with the server's flags
    (``num_gpu_blocks * block_size``, what it logs as "GPU KV cache size")."""
    if engine == "labkit":
        from labkit.engine.llm_engine import LLMEngine

        args = _teaching_engine_args(cfg)
        blocks = LLMEngine(args).num_gpu_blocks
        per_request = cdiv(cfg.max_model_len or served_model_spec(cfg).max_position_embeddings,
                           args.block_size)
        return KVCacheReport(blocks * args.block_size, blocks / per_request,
                             f"labkit's engine: {blocks:,} blocks of {args.block_size} tokens")
    report = read_kv_cache_line(server.log_lines())
    if report is None:
        raise RuntimeError(f"no KV cache size line in the server's log ({server.log_path})")
    return report


def kv_cache_predicted(engine: str, cfg: ServeConfig,
                       path: LabPath | None = None) -> KVCacheReport:
    """Chapter 1's prediction of the KV cache ``cfg`` gets here: on vLLM's CPU build
    ``VLLM_CPU_KVCACHE_SPACE`` GiB over the bytes per token; on a GPU
    :func:`~labkit.hardware.plan_kv_cache` for the first GPU; for the teaching engine, its simulated
    device's budget less weights and activations, in whole blocks."""
    from labkit.hardware import (activation_bytes, kv_cache_bytes_per_token, num_kv_blocks,
                                 plan_kv_cache, weight_bytes)

    path = path or detect()
    spec = served_model_spec(cfg)
    max_model_len = cfg.max_model_len or spec.max_position_embeddings
    if engine == "vllm" and path.runs("vllm") == "cpu":
        from labkit import vllm_cpu

        plan = vllm_cpu.plan_cpu_kv_cache(spec, max_model_len, cfg.dtype,
                                          cfg.tensor_parallel_size)
        return KVCacheReport(plan.tokens, plan.max_concurrency,
                             f"{plan.kv_cache_space_gib:g} GiB / {plan.bytes_per_token} bytes "
                             f"per token, in blocks of {plan.block_size}")
    if engine == "vllm":
        plan = plan_kv_cache(spec, path.gpus[0], cfg.tensor_parallel_size,
                             cfg.gpu_memory_utilization, max_model_len=max_model_len)
        return KVCacheReport(plan.kv_cache_tokens, plan.max_concurrency,
                             f"plan_kv_cache on {plan.gpu}: {plan.kv_cache_gib:.2f} GiB left "
                             f"after weights and activations")
    if engine != "labkit":
        raise ValueError(f"engine must be 'vllm' or 'labkit', got {engine!r}")
    args = _teaching_engine_args(cfg)
    budget = args.device_memory_gib * 2**30 * args.gpu_memory_utilization
    blocks = num_kv_blocks(
        budget, weights_bytes=weight_bytes(spec, "fp32"),
        activations_bytes=activation_bytes(spec, args.max_num_batched_tokens,
                                           args.max_num_seqs, act_dtype_bytes=4),
        block_bytes=args.block_size * kv_cache_bytes_per_token(spec, "fp32"))
    return KVCacheReport(blocks * args.block_size, blocks / cdiv(max_model_len, args.block_size),
                         f"{args.device_memory_gib:g} GiB x {args.gpu_memory_utilization} less "
                         f"weights and activations, fp32 blocks of {args.block_size}")


async def benchmark_variants(requests: Sequence, variants: Mapping[str, Mapping],
                             wanted: str = "vllm", *, baseline: tuple[str, str] | None = None,
                             path: LabPath | None = None, warmup_requests: int = 2,
                             **bench_kwargs) -> dict:
    """Benchmark the same ``requests`` on one server per variant (:ref:`ch02-benchmarking` and
    chapter 3).

    ``variants`` maps a name to :func:`start_lab_server` options (``{"extra_args":
    ["--no-enable-prefix-caching"]}``, ``{"max_num_seqs": 1}``, ...); each server is started,
    warmed up with the first ``warmup_requests`` requests, measured with
    :func:`labkit.bench.benchmark_async` (``bench_kwargs``) and stopped before the next one
    starts, so no two variants share the machine. ``baseline=(name, base_url)`` measures a
    server that is already running first. Returns ``{name: BenchmarkResult}`` in that order.
    """
    from labkit.bench import benchmark_async

    model = LAB_SERVER_DEFAULTS["served_model_name"]
    results = {}
    targets = [(baseline[0], baseline[1], None)] if baseline else []
    targets += [(name, None, options) for name, options in variants.items()]
    for name, base_url, options in targets:
        server = None
        if base_url is None:
            _, cfg, server = start_lab_server(wanted, path, **options)
            base_url = cfg.base_url
        try:
            if warmup_requests:
                await benchmark_async(base_url, model, requests[:warmup_requests])
            results[name] = await benchmark_async(base_url, model, requests, **bench_kwargs)
        finally:
            if server is not None:
                server.stop()
    return results


def decode_step_s(base_url: str, model: str, num_tokens: int = 64, repeats: int = 5,
                  prompt: str = "Tensor parallelism splits") -> float:
    """Seconds per decode step of one sequence, timed from outside (:ref:`ch03-tensor-parallelism`):
    the median time of a request for ``num_tokens + 1`` tokens less that of a request for one,
    divided by ``num_tokens``. Requests are not streamed, so nothing depends on how the server
    groups its stream chunks."""
    positive_int("num_tokens", num_tokens)
    positive_int("repeats", repeats)

    def median_s(max_tokens: int) -> float:
        times = []
        with httpx.Client(base_url=base_url, timeout=120) as http:
            for _ in range(repeats):
                start = time.perf_counter()
                response = http.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True})
                response.raise_for_status()
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    median_s(1)  # warm up
    return (median_s(num_tokens + 1) - median_s(1)) / num_tokens


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


def vllm_python(path: LabPath | None = None) -> str | None:
    """The Python that has vLLM on this machine: this kernel's on the GPU path, vLLM's CPU
    environment on the CPU path, None where only the teaching engine runs."""
    path = path or detect()
    runs = path.runs("vllm")
    return sys.executable if runs == "gpu" else path.vllm_cpu_python if runs == "cpu" else None


def max_tensor_parallel_size(path: LabPath | None = None) -> int:
    """How many tensor-parallel ranks vLLM can run here: one per GPU on the GPU path, one per
    allowed CPU on vLLM's CPU build, 1 for the teaching engine (one device)."""
    path = path or detect()
    runs = path.runs("vllm")
    return len(path.gpus) if runs == "gpu" else len(os.sched_getaffinity(0)) if runs == "cpu" else 1


@dataclass(frozen=True)
class TensorParallelRun:
    """What one vLLM server of ``tensor_parallel_size`` ranks did (:ref:`ch03-tensor-parallelism`):
    its greedy completions, its decode step time, its KV-cache line and its ranks' log lines."""

    tensor_parallel_size: int
    texts: tuple[str, ...]
    decode_step_s: float
    kv_cache: KVCacheReport | None
    rank_lines: tuple[str, ...]


def run_tensor_parallel(tp_sizes: Sequence[int], prompts: Sequence[str], max_tokens: int = 32,
                        path: LabPath | None = None, **options) -> dict[int, TensorParallelRun]:
    """Serve the lab's model with each tensor-parallel size in turn, one server at a time
    (:func:`start_lab_server` with ``tensor_parallel_size``, ``options`` on top): greedy
    completions of ``prompts``, :func:`decode_step_s`, the KV-cache line and each rank's log
    lines."""
    from labkit.vllm_cpu import rank_log_lines

    path = path or detect()
    runs = {}
    for tp in tp_sizes:
        _, cfg, server = start_lab_server("vllm", path, **options, tensor_parallel_size=tp)
        try:
            with httpx.Client(base_url=cfg.base_url, timeout=120) as http:
                texts = tuple(http.post("/v1/completions", json={
                    "model": cfg.name, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0}).raise_for_status().json()["choices"][0]["text"]
                    for prompt in prompts)
            step_s = decode_step_s(cfg.base_url, cfg.name)
            lines = server.log_lines()
            runs[tp] = TensorParallelRun(tp, texts, step_s, read_kv_cache_line(lines),
                                         tuple(rank_log_lines(lines)))
        finally:
            server.stop()
    return runs
