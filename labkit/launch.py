"""Launch real inference engines: one config, four command lines (chapter 2.2-2.4).

``ServeConfig`` holds the deployment options the tutorial uses (tensor parallelism, memory
fraction, context length, quantization, served name) with safe defaults: bind to localhost,
never ``--trust-remote-code`` unless asked. It renders to ``vllm serve``, SGLang's
``launch_server``, TensorRT-LLM's ``trtllm-serve`` (and the older convert/build steps), and
``labkit serve``, the teaching engine that stands in on machines without a GPU.
``ServerProcess`` starts any of them, waits for ``/health`` and stops the whole process group.
"""

from __future__ import annotations

import csv
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import httpx

from labkit.checks import in_range, positive_int
from labkit.lab import LabPath, detect


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
    extra_args: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a model name or directory")
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        in_range("port", self.port, 1, 65535)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)

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


def trtllm_command(cfg: ServeConfig, backend: str = "pytorch") -> list[str]:
    """``trtllm-serve``: TensorRT-LLM's OpenAI-compatible server.

    ``backend="pytorch"`` serves a Hugging Face checkpoint with no build step;
    ``"tensorrt"`` serves an engine directory made by ``trtllm-build``. Its KV-cache knob is
    the fraction of memory left *after* the weights, not of the whole GPU: the same number
    means something different than in vLLM.
    """
    if backend not in ("pytorch", "tensorrt"):
        raise ValueError(f"backend must be 'pytorch' or 'tensorrt', got {backend!r}")
    return ["trtllm-serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
            "--backend", backend, "--tp_size", str(cfg.tensor_parallel_size),
            "--kv_cache_free_gpu_memory_fraction", str(cfg.gpu_memory_utilization),
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
    """The command line that serves ``cfg`` with ``engine``, a name in :data:`COMMANDS` (2.2)."""
    if engine not in COMMANDS:
        raise ValueError(f"engine must be one of {tuple(COMMANDS)}, got {engine!r}")
    return COMMANDS[engine](cfg)


def choose_engine(wanted: str, path: LabPath | None = None) -> str:
    """``wanted`` when this machine can run it (a CUDA GPU and the package), else ``labkit``."""
    path = path or detect()
    return wanted if wanted == "labkit" or path.uses(wanted) else "labkit"


class ServerProcess:
    """A server subprocess: started in its own process group, healthy, then stopped whole.

        with ServerProcess(command_for("labkit", cfg), cfg.base_url) as server:
            ...  # server.base_url answers OpenAI requests
    """

    def __init__(self, command: Sequence[str], base_url: str, startup_timeout_s: float = 600):
        self.command, self.base_url = list(command), base_url
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log",
                                               delete=False)

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
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
        if self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


#: The model GPU-path labs serve unless ``LABKIT_GPU_MODEL`` names another.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def lab_model(engine: str) -> str:
    """The model a lab serves: a real one on the GPU path, the tiny local one on the CPU path.

    The tiny model is written once to ``$LABKIT_CACHE`` (default ``~/.cache/labkit``).
    """
    if engine != "labkit":
        return os.environ.get("LABKIT_GPU_MODEL", DEFAULT_GPU_MODEL)
    from pathlib import Path

    from labkit.engine.tiny import write_tiny_model

    cache = Path(os.environ.get("LABKIT_CACHE", Path.home() / ".cache" / "labkit"))
    target = cache / "tiny-llama"
    if not (target / "model.safetensors").is_file():
        write_tiny_model(target)
    return str(target)


def offline_api(engine: str):
    """``(LLM, SamplingParams)`` of vLLM on the GPU path, of the teaching engine otherwise."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
    elif engine == "labkit":
        from labkit.engine import LLM, SamplingParams
    else:
        raise ValueError(f"engine must be 'vllm' or 'labkit' for the offline API, got {engine!r}")
    return LLM, SamplingParams


def start_lab_server(wanted: str, served_model_name: str = "course-model",
                     max_model_len: int = 1024,
                     path: LabPath | None = None) -> tuple[str, ServeConfig, ServerProcess]:
    """Start the server a lab is about: ``wanted`` on the GPU path, ``labkit`` otherwise.

    Returns the engine that runs, its config and the started :class:`ServerProcess`, which the
    lab stops when done.
    """
    engine = choose_engine(wanted, path)
    cfg = ServeConfig(model=lab_model(engine), served_model_name=served_model_name,
                      port=free_port(), max_model_len=max_model_len)
    return engine, cfg, ServerProcess(command_for(engine, cfg), cfg.base_url).start()


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
