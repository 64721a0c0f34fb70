"""The engine a lab runs, on this machine's path, and the chapter 2-3 experiments on it
(:ref:`ch02-vllm`, :ref:`ch02-benchmarking`, :ref:`ch03-tensor-parallelism`).

A lab about an inference engine takes one of three paths (:mod:`labkit.lab` detects which):
the real engine on a GPU, vLLM's CPU build, or labkit's teaching engine. This module turns that
path into running things: the model to serve (:func:`lab_model`), the offline API
(:func:`offline_api`), the server with its command line and environment
(:func:`start_lab_server`, :func:`start_server`), and the experiments the chapters run on it:
the KV cache a server reports against chapter 1's prediction (:func:`kv_cache_reported`,
:func:`kv_cache_predicted`), one benchmark per server setting (:func:`benchmark_variants`),
the decode step timed from outside (:func:`decode_step_s`) and tensor parallelism rank by rank
(:func:`run_tensor_parallel`). The command lines themselves come from :mod:`labkit.launch`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import httpx

from labkit import vllm_cpu
from labkit.bench import benchmark_async
from labkit.checks import ParameterError, positive_int
from labkit.data import read_csv
from labkit.deploy.spec import API_KEY_ENV
from labkit.engine import LLM, EngineArgs, LLMEngine, SamplingParams, write_tiny_model
from labkit.engine.args import parse_engine_args
from labkit.hardware import (ModelSpec, activation_bytes, kv_cache_bytes_per_token,
                             max_concurrency, num_kv_blocks, plan_kv_cache, weight_bytes)
from labkit.lab import LabPath, detect
from labkit.launch import ServeConfig, command_for, labkit_command, vllm_command
from labkit.process import ServerProcess, free_port


def choose_engine(wanted: str, path: LabPath | None = None) -> str:
    """``wanted`` when this machine can run it (on a GPU, or vLLM's CPU build), else
    ``labkit``, the teaching engine (chapter 2)."""
    path = path or detect()
    return wanted if wanted == "labkit" or path.runs(wanted) != "teaching" else "labkit"


#: The model GPU-path labs serve unless ``LABKIT_GPU_MODEL`` names another.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def lab_model(engine: str, path: LabPath | None = None) -> str:
    """The model a lab serves (chapter 2): a real one on the GPU path, the tiny local one on
    the CPU paths (real vLLM on CPU serves it too: nothing is downloaded).

    The tiny model is written once to ``$LABKIT_CACHE`` (default ``~/.cache/labkit``): aside,
    then renamed into place, since two processes may ask at once (two labs open, two test
    workers) and neither may load a half-written checkpoint.
    """
    if (path or detect()).runs(engine) == "gpu":
        return os.environ.get("LABKIT_GPU_MODEL", DEFAULT_GPU_MODEL)
    cache = Path(os.environ.get("LABKIT_CACHE", Path.home() / ".cache" / "labkit"))
    target = cache / "tiny-llama"
    if not (target / "model.safetensors").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=cache))
        write_tiny_model(scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process renamed its copy into place first
            shutil.rmtree(scratch, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise ParameterError("LABKIT_CACHE", f"LABKIT_CACHE: {target} holds an incomplete "
                                                 "tiny model; delete that folder")
    return str(target)


def offline_api(engine: str, path: LabPath | None = None):
    """``(LLM, SamplingParams)`` for a lab about ``engine``'s offline API on this machine
    (:ref:`ch02-offline-api`).

    vLLM's own classes on the GPU path; on the vLLM-on-CPU path an ``LLM`` that runs vLLM in
    its environment (:class:`labkit.vllm_cpu.RemoteLLM`) with the teaching engine's
    ``SamplingParams``; the teaching engine's pair otherwise.
    """
    if engine not in ("vllm", "labkit"):
        raise ParameterError("engine", f"engine must be 'vllm' or 'labkit' for the offline API, "
                                       f"got {engine!r}")
    path = path or detect()
    runs = path.runs(engine)
    if engine == "vllm" and runs == "gpu":
        from vllm import LLM as VLLM  # only where the GPU path installed it
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLM, VLLMSamplingParams
    if engine == "vllm" and runs == "cpu":
        return partial(vllm_cpu.RemoteLLM, path.vllm_cpu_python,
                       **vllm_cpu.LAB_ENGINE_ARGS), SamplingParams
    return LLM, SamplingParams


#: Environment variables of a vLLM server on CPU that every lab of a test run shares (startup
#: takes a minute): its URL and its log. Set by the test suite; labs asking for the default
#: server attach to it instead of starting their own.
SHARED_VLLM_URL, SHARED_VLLM_LOG = "LABKIT_VLLM_URL", "LABKIT_VLLM_LOG"


#: The server a lab starts unless it asks for other options.
LAB_SERVER_DEFAULTS = {"served_model_name": "course-model", "max_model_len": 1024}


def start_lab_server(wanted: str, path: LabPath | None = None, *, api_key: str | None = None,
                     **options) -> tuple[str, ServeConfig, ServerProcess]:
    """Start the server a lab is about (chapter 2): ``wanted`` on its GPU path, real vLLM on
    CPU when that is installed, the teaching engine (``labkit``) otherwise.

    ``options`` are :class:`~labkit.launch.ServeConfig` fields (vLLM's names:
    ``max_num_seqs``, ``tensor_parallel_size``, ``extra_args=["--no-enable-prefix-caching"]``,
    ...) on top of :data:`LAB_SERVER_DEFAULTS`. Returns the engine that runs, its config and
    the started :class:`~labkit.process.ServerProcess`, which the lab stops when done.
    ``api_key`` protects its ``/v1`` routes, handed over as ``VLLM_API_KEY`` (chapter 8): vLLM
    and ``labkit serve`` both read it there, and it never shows in ``ps``. With no options
    and no key, vLLM on CPU is the test run's shared server when there is one
    (``LABKIT_VLLM_URL``).
    """
    path = path or detect()
    engine = choose_engine(wanted, path)
    cfg = ServeConfig(model=lab_model(engine, path), port=free_port(),
                      **{**LAB_SERVER_DEFAULTS, **options})
    shared = os.environ.get(SHARED_VLLM_URL)
    if (engine == "vllm" and path.runs("vllm") == "cpu" and shared and not options
            and not api_key):
        cfg = replace(cfg, port=int(shared.rsplit(":", 1)[1]))
        return engine, cfg, ServerProcess.attach(shared, os.environ.get(SHARED_VLLM_LOG))
    return engine, cfg, start_server(engine, cfg, path,
                                     env={API_KEY_ENV: api_key} if api_key else None)


def engine_table_markdown(columns: Sequence[str] = ("kv_cache", "prefix_cache", "batching",
                                                      "structured_output", "quantization",
                                                      "hardware", "server")) -> str:
    """The framework comparison of :ref:`ch02-which-engine` from ``labkit/data/engines.csv``
    (sourced rows)."""
    rows = read_csv("engines.csv")
    header = "| | " + " | ".join(row["engine"] for row in rows) + " |"
    lines = [header, "|---" * (len(rows) + 1) + "|"]
    for column in columns:
        cells = " | ".join(row[column] for row in rows)
        lines.append(f"| {column.replace('_', ' ')} | {cells} |")
    return "\n".join(lines)


def flag_table_markdown(cfg: ServeConfig) -> str:
    """The same deployment options as each engine spells them, rendered from ``cfg``
    (:ref:`ch02-sglang`)."""
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
    """The command that serves ``cfg`` with ``engine`` here (:ref:`ch02-vllm`):
    :func:`~labkit.launch.command_for`'s, except that vLLM's CPU build starts as
    ``python -m vllm.entrypoints.openai.api_server``, in eager mode
    (:data:`labkit.vllm_cpu.LAB_ENGINE_ARGS`)."""
    path = path or detect()
    if engine == "vllm" and path.runs("vllm") == "cpu":
        eager = [] if "--enforce-eager" in cfg.extra_args or _quantized(cfg) \
            else ["--enforce-eager"]
        return vllm_cpu.server_command(path.vllm_cpu_python, [*vllm_command(cfg), *eager])
    return command_for(engine, cfg)


def _quantized(cfg: ServeConfig) -> bool:
    """Whether ``cfg`` serves a quantized checkpoint: vLLM 0.32's CPU build served lab 04's
    AWQ (W4A16) checkpoint compiled, but in eager mode its server stopped answering after it
    got healthy (2026-12-07), so quantized checkpoints keep the default."""
    config = Path(cfg.model) / "config.json"
    return bool(cfg.quantization) or (config.is_file() and "quantization_config"
                                      in json.loads(config.read_text(encoding="utf-8")))


def lab_server_env(engine: str, cfg: ServeConfig, path: LabPath | None = None) -> dict[str, str]:
    """Environment variables the server of ``cfg`` needs here (:ref:`ch02-vllm`): for vLLM a
    plain log (Jupyter kernels set ``FORCE_COLOR``, which vLLM honours even in a file); on its
    CPU build also the KV cache's host memory and, with several ranks, the cores of each
    rank."""
    path = path or detect()
    if engine != "vllm":
        return {}
    env = {"VLLM_LOGGING_COLOR": "0"}
    if path.runs("vllm") == "cpu":
        env |= {**vllm_cpu.cpu_env(), **vllm_cpu.parallel_env(cfg.tensor_parallel_size)}
    return env


def start_server(engine: str, cfg: ServeConfig, path: LabPath | None = None,
                 startup_timeout_s: float = 600,
                 env: Mapping[str, str] | None = None) -> ServerProcess:
    """Start ``cfg`` (any model, any options) on ``engine`` as this machine runs it and wait
    until it is healthy (:ref:`ch02-streaming`): :func:`lab_server_command` with
    :func:`lab_server_env`, and ``env`` on top."""
    return ServerProcess(lab_server_command(engine, cfg, path), cfg.base_url, startup_timeout_s,
                         env={**lab_server_env(engine, cfg, path), **(env or {})}).start()


def served_model_spec(cfg: ServeConfig) -> ModelSpec:
    """The :class:`~labkit.hardware.ModelSpec` of the model ``cfg`` serves (chapter 2): from
    its directory, or from the Hugging Face cache for a repository name (the GPU path downloads
    it there)."""
    if Path(cfg.model).is_dir():
        return ModelSpec.from_hf_config(cfg.model)
    from huggingface_hub import try_to_load_from_cache  # the GPU path's download cache

    config = try_to_load_from_cache(cfg.model, "config.json")
    if not isinstance(config, str):
        raise ParameterError("model", f"model: no config.json for {cfg.model!r} in the "
                                      "Hugging Face cache")
    return ModelSpec.from_hf_config(config, name=cfg.model)


# -- the KV cache a server reports, and chapter 1's prediction of it -------------------------

@dataclass(frozen=True)
class KVCacheReport:
    """A KV-cache size in vLLM's terms, as an engine reported it or as chapter 1's rule
    predicts it (:ref:`ch02-vllm`): tokens, how many ``max_model_len`` requests fit, and
    the block size in tokens where the source knows it (vLLM's log line does not print it)."""

    tokens: int
    max_concurrency: float
    source: str
    block_size: int | None = None

    def __str__(self) -> str:
        return (f"{self.tokens:,} tokens, maximum concurrency {self.max_concurrency:,.2f}x "
                f"({self.source})")


_KV_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for "
                      r"([\d,]+) tokens per request: ([\d.,]+)x")


def read_kv_cache_line(lines: Sequence[str]) -> KVCacheReport | None:
    """vLLM's startup line "GPU (or CPU) KV cache size: N tokens, Maximum concurrency for L
    tokens per request: Cx" from its log, the last one if several; None if absent
    (:ref:`ch02-vllm`). vLLM computes it in ``update_kv_cache_capacity``
    (``vllm/v1/core/kv_cache_utils.py``)."""
    for line in reversed(vllm_cpu.plain_log(lines)):
        match = _KV_LINE.search(line)
        if match:
            return KVCacheReport(int(match[2].replace(",", "")),
                                 float(match[4].replace(",", "")), match[0])
    return None


def _teaching_engine_args(cfg: ServeConfig) -> EngineArgs:
    """The :class:`~labkit.engine.EngineArgs` that ``labkit serve`` builds from ``cfg``'s
    command line, read by the server's own parser."""
    command = labkit_command(cfg)
    return parse_engine_args(command[command.index("serve") + 1:])


def kv_cache_reported(engine: str, cfg: ServeConfig, server: ServerProcess) -> KVCacheReport:
    """The KV cache the running server reports (:ref:`ch02-vllm`): vLLM's startup log line
    (GPU or CPU build); for the teaching engine, the blocks its engine allocates with the
    server's flags (``num_gpu_blocks * block_size``, what it logs as "GPU KV cache size")."""
    if engine == "labkit":
        args = _teaching_engine_args(cfg)
        blocks = LLMEngine(args).num_gpu_blocks
        max_model_len = cfg.max_model_len or served_model_spec(cfg).max_position_embeddings
        return KVCacheReport(blocks * args.block_size,
                             max_concurrency(blocks, args.block_size, max_model_len),
                             f"labkit's engine: {blocks:,} blocks of {args.block_size} tokens",
                             args.block_size)
    report = read_kv_cache_line(server.log_lines())
    if report is None:
        raise RuntimeError(f"no KV cache size line in the server's log ({server.log_path})")
    return report


def kv_cache_predicted(engine: str, cfg: ServeConfig,
                       path: LabPath | None = None) -> KVCacheReport:
    """Chapter 1's prediction of the KV cache ``cfg`` gets here (:ref:`ch02-vllm`): on vLLM's
    CPU build ``VLLM_CPU_KVCACHE_SPACE`` GiB over the bytes per token; on a GPU
    :func:`~labkit.hardware.plan_kv_cache` for the first GPU; for the teaching engine, its
    simulated device's budget less weights and activations, in whole blocks."""
    if engine not in ("vllm", "labkit"):
        raise ParameterError("engine", f"engine must be 'vllm' or 'labkit', got {engine!r}")
    path = path or detect()
    spec = served_model_spec(cfg)
    max_model_len = cfg.max_model_len or spec.max_position_embeddings
    if engine == "vllm" and path.runs("vllm") == "cpu":
        plan = vllm_cpu.plan_cpu_kv_cache(spec, max_model_len, cfg.dtype,
                                          cfg.tensor_parallel_size)
        return KVCacheReport(plan.tokens, plan.max_concurrency,
                             f"{plan.kv_cache_space_gib:g} GiB / {plan.bytes_per_token} bytes "
                             f"per token, in blocks of {plan.block_size}", plan.block_size)
    if engine == "vllm":
        plan = plan_kv_cache(spec, path.gpus[0], cfg.tensor_parallel_size,
                             cfg.gpu_memory_utilization, max_model_len=max_model_len)
        return KVCacheReport(plan.kv_cache_tokens, plan.max_concurrency,
                             f"plan_kv_cache on {plan.gpu}: {plan.kv_cache_gib:.2f} GiB left "
                             f"after weights and activations", plan.block_size)
    args = _teaching_engine_args(cfg)
    budget = args.device_memory_gib * 2**30 * args.gpu_memory_utilization
    blocks = num_kv_blocks(
        budget, weights_bytes=weight_bytes(spec, "fp32"),
        activations_bytes=activation_bytes(spec, args.max_num_batched_tokens,
                                           args.max_num_seqs, act_dtype_bytes=4),
        block_bytes=args.block_size * kv_cache_bytes_per_token(spec, "fp32"))
    return KVCacheReport(blocks * args.block_size,
                         max_concurrency(blocks, args.block_size, max_model_len),
                         f"{args.device_memory_gib:g} GiB x {args.gpu_memory_utilization} less "
                         f"weights and activations, fp32 blocks of {args.block_size}",
                         args.block_size)


# -- experiments: one server per setting, decode steps, tensor parallelism -------------------

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
                await benchmark_async(base_url, model, requests[:warmup_requests],
                                      tokenizer=bench_kwargs.get("tokenizer"))
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


def vllm_python(path: LabPath | None = None) -> str | None:
    """The Python that has vLLM on this machine (chapter 2): this kernel's on the GPU path,
    vLLM's CPU environment on the CPU path, None where only the teaching engine runs."""
    path = path or detect()
    runs = path.runs("vllm")
    return sys.executable if runs == "gpu" else path.vllm_cpu_python if runs == "cpu" else None


def max_tensor_parallel_size(path: LabPath | None = None) -> int:
    """How many tensor-parallel ranks vLLM can run here (:ref:`ch03-tensor-parallelism`): one
    per GPU on the GPU path, one per allowed CPU on vLLM's CPU build, 1 for the teaching engine
    (one device)."""
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
    (:ref:`ch03-tensor-parallelism`; :func:`start_lab_server` with ``tensor_parallel_size``,
    ``options`` on top): greedy completions of ``prompts``, :func:`decode_step_s`, the KV-cache
    line and each rank's log lines."""
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
                                         tuple(vllm_cpu.rank_log_lines(lines)))
        finally:
            server.stop()
    return runs
