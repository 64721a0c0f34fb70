"""Every GPU path of the course in one run, for a session that is lent a GPU (under 10 minutes).

CI and most sessions have no GPU, so what only a GPU can show is gathered here, ready to run
the moment one is there:

1. **The engine labs on their real engines.** For vLLM, SGLang and TensorRT-LLM, each one
   installed, its labs (``labs/gpu/*``; ``--all-labs`` adds the vLLM labs of chapters 2-4) run
   top to bottom in a fresh kernel on the GPU path, as a student's would; an engine that is
   not installed is named, not faked.
2. **Chapter 1's datasheet against the chip.** A device-to-device copy (bytes read plus
   written) and a bf16 matrix product, as fractions of labkit's row for this GPU
   (``labkit/data/gpus.csv``).
3. **Chapter 1's roofline against a real decode step.** One decode step of a model of the
   preset's shape (default Llama-3-8B) with random bf16 weights, written out in PyTorch the
   way an engine runs it (embedding rows, RMSNorm, fused q/k/v and gate/up projections, the
   new K/V written into a cache, attention over the context, the LM head), at several batch
   sizes. Timed twice: launched op by op (eager, what Python overhead costs) and replayed as
   one CUDA graph (what vLLM does), against :func:`labkit.hardware.decode_step`'s bound for
   the same step. The step touches exactly the bytes that bound counts (a test holds the
   two equal), so the ratio is the kernels' efficiency, not a different workload.

Prints a table per part and writes ``gpu_check.json`` (to ``$OUT`` when that is set, as on
the device machine, else the current directory). Nothing is asserted: it measures.

    python benchmarks/gpu_check.py                       # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --device cpu --model tiny --batch-sizes 1,2   # a dry run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine gets the checkout, not an installed labkit

from labkit.hardware import ModelSpec, get_gpu, get_model, list_gpus  # noqa: E402
from labkit.hardware.roofline import decode_step  # noqa: E402

#: The engines of chapter 2, by import name, and the lab each one's path runs.
ENGINE_LABS = {"vllm": ["gpu/vllm_deploy_benchmark"], "sglang": ["gpu/sglang"],
               "tensorrt_llm": ["gpu/tensorrt_llm"]}
#: Labs of chapters 2-4 whose GPU path is vLLM too (``--all-labs``; minutes each).
MORE_VLLM_LABS = ["02_offline_inference", "02_openai_server", "02_benchmark_serving",
                  "03_tensor_parallel", "04_quantization_tools"]
#: A model small enough for a dry run on a CPU (``--model tiny``).
TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)


# -- 1. the engine labs ---------------------------------------------------------------------


@dataclass
class LabRun:
    lab: str
    engine: str
    outcome: str  # "passed", "failed: ...", or why it did not run
    seconds: float = 0.0


def run_engine_labs(all_labs: bool, timeout_s: int = 540) -> list[LabRun]:
    """Each installed engine's labs, executed top to bottom with nbclient on its GPU path."""
    runs = []
    have_nbclient = importlib.util.find_spec("nbclient") is not None
    for engine, labs in ENGINE_LABS.items():
        labs = labs + (MORE_VLLM_LABS if all_labs and engine == "vllm" else [])
        installed = importlib.util.find_spec(engine) is not None
        for lab in labs:
            if not installed:
                runs.append(LabRun(lab, engine, f"not run: {engine} is not installed"))
            elif not have_nbclient:
                runs.append(LabRun(lab, engine, "not run: nbclient is not installed"))
            else:
                runs.append(_execute(lab, engine, timeout_s))
    return runs


def _execute(lab: str, engine: str, timeout_s: int) -> LabRun:
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "labs" / f"{lab}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        outcome = "passed"
    except Exception as err:  # the lab's own error, reported rather than raised
        outcome = f"failed: {type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"
    banner = next((o.get("text", "") for c in notebook.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if "path" in o.get("text", "").lower()), "")
    if banner:
        outcome += f" ({banner.strip().splitlines()[0][:120]})"
    return LabRun(lab, engine, outcome, time.perf_counter() - start)


# -- 2. the datasheet ------------------------------------------------------------------------


def gpu_row(device_name: str) -> str:
    """labkit's row for a CUDA device name: "NVIDIA H200" -> "H200 SXM", "NVIDIA
    A100-SXM4-80GB" -> "A100 80GB". A row qualifies when its model number (its first word
    with a digit) is a word of the name; of those, the one with most words in the name wins,
    then an SXM part (the one NVIDIA's plain names, such as "NVIDIA H100 80GB HBM3", are)."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))

    def model_number(row: str) -> str:
        return next(w for w in row.upper().split() if any(ch.isdigit() for ch in w))

    rows = [g.name for g in list_gpus() if model_number(g.name) in words]
    if not rows:
        raise ValueError(f"no row in labkit/data/gpus.csv for {device_name!r}; pass --gpu")
    return max(rows, key=lambda r: (sum(w in words for w in r.upper().split()), "SXM" in r))


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def datasheet_check(gpu: str, device: torch.device, copy_bytes: int = 2 << 30,
                    gemm_n: int = 8192) -> dict:
    """Measured copy bandwidth and bf16 matmul rate against the datasheet row ``gpu``."""
    row = get_gpu(gpu)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, 10)
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    gemm_s = _timed(lambda: a @ b, device, 10)
    bandwidth = 2 * copy_bytes / copy_s  # each byte read once and written once
    flops = 2 * gemm_n ** 3 / gemm_s
    return {"gpu_row": gpu, "copy_gb_s": bandwidth / 1e9,
            "datasheet_gb_s": row.mem_bandwidth_gb_s,
            "copy_of_datasheet": bandwidth / row.mem_bandwidth_bytes_s,
            "bf16_tflops": flops / 1e12, "datasheet_bf16_tflops": row.bf16_tflops,
            "bf16_of_datasheet": flops / row.peak_ops_s("bf16")}


# -- 3. one decode step ----------------------------------------------------------------------


class DecodeStep:
    """One decode step of ``spec`` for ``batch_size`` sequences whose context (the new token
    included) is ``context_len`` tokens, with random bf16 weights on ``device``.

    Dense models only (``spec.num_experts == 1``). No rotary embedding: on one new token a
    sequence it is a few FLOPs and no memory traffic, nothing the roofline would see. Tensors
    live on ``device``; on ``"meta"`` nothing is allocated, which is how
    :meth:`bytes_touched` is checked for a large model.
    """

    def __init__(self, spec: ModelSpec, batch_size: int, context_len: int,
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> None:
        if spec.is_moe:
            raise ValueError("DecodeStep models dense layers only; spec is a mixture of experts")
        self.spec, self.batch_size, self.context_len = spec, batch_size, context_len
        device = torch.device(device)
        generator = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)

        def weight(*shape):
            if device.type == "meta":
                return torch.empty(shape, dtype=dtype, device=device)
            # Scaled so activations stay O(1) through the layers (no inf in a timed run).
            return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
                    / shape[0] ** 0.5).to(dtype)

        h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
        self.embedding = weight(spec.vocab_size, h)
        self.layers = [{
            "input_norm": weight(h), "qkv": weight(h, q + 2 * kv),
            "qkv_bias": weight(q + 2 * kv) if spec.qkv_bias else None,
            "o": weight(q, h), "o_bias": weight(h) if spec.o_bias else None,
            "post_norm": weight(h), "gate_up": weight(h, 2 * spec.intermediate_size),
            "down": weight(spec.intermediate_size, h),
            # The cache: every sequence's context_len - 1 earlier tokens, plus room for one.
            "k": weight(batch_size, spec.num_kv_heads, context_len, spec.head_dim),
            "v": weight(batch_size, spec.num_kv_heads, context_len, spec.head_dim),
        } for _ in range(spec.num_layers)]
        self.final_norm = weight(h)
        self.lm_head = self.embedding if spec.tie_word_embeddings else weight(h, spec.vocab_size)
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=device)

    def bytes_touched(self) -> int:
        """Bytes one step reads or writes in memory: every weight once (of the embedding table
        only the looked-up rows), every sequence's cached K/V and the new token's K/V."""
        s, b = self.spec, self.batch_size
        weights = [t for layer in self.layers for name, t in layer.items()
                   if name not in ("k", "v") and t is not None]
        total = sum(t.nbytes for t in weights) + self.final_norm.nbytes
        if s.tie_word_embeddings:
            total += self.embedding.nbytes  # read whole as the LM head, looked-up rows included
        else:
            total += self.lm_head.nbytes + b * s.hidden_size * self.embedding.element_size()
        kv_row = self.layers[0]["k"].element_size() * s.head_dim * s.num_kv_heads
        total += 2 * s.num_layers * b * self.context_len * kv_row  # context - 1 read, 1 written
        return total

    def __call__(self) -> torch.Tensor:
        """The step's logits, ``[batch_size, vocab]``."""
        s = self.spec
        pos = self.context_len - 1
        x = self.embedding[self.tokens]
        for layer in self.layers:
            hidden = _rms_norm(x, layer["input_norm"])
            qkv = hidden @ layer["qkv"]
            if layer["qkv_bias"] is not None:
                qkv = qkv + layer["qkv_bias"]
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            layer["k"][:, :, pos] = k.view(-1, s.num_kv_heads, s.head_dim)
            layer["v"][:, :, pos] = v.view(-1, s.num_kv_heads, s.head_dim)
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.view(-1, s.num_attention_heads, 1, s.head_dim), layer["k"], layer["v"],
                enable_gqa=s.num_kv_heads != s.num_attention_heads)
            out = attn.reshape(-1, s.q_size) @ layer["o"]
            if layer["o_bias"] is not None:
                out = out + layer["o_bias"]
            x = x + out
            gate, up = (_rms_norm(x, layer["post_norm"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ layer["down"]
        return _rms_norm(x, self.final_norm) @ self.lm_head


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight


def decode_roofline(spec: ModelSpec, gpu: str, batch_sizes: list[int], context_len: int,
                    device: torch.device, repeats: int = 20) -> list[dict]:
    """Measured decode steps (eager, and as a CUDA graph on a GPU) against the roofline."""
    rows = []
    for batch in batch_sizes:
        step = DecodeStep(spec, batch, context_len, device)
        bound = decode_step(spec, gpu, batch, context_len)
        with torch.inference_mode():
            eager_s = _timed(step, device, repeats)
            graph_s = None
            if device.type == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step()  # warm-up on a side stream, as CUDA graph capture requires
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph_s = _timed(graph.replay, device, repeats)
        best = graph_s if graph_s is not None else eager_s
        rows.append({"batch_size": batch, "context_len": context_len,
                     "bytes_touched": step.bytes_touched(), "roofline_bytes": bound.bytes_moved,
                     "roofline_ms": 1e3 * bound.time_s, "bound": bound.bound,
                     "eager_ms": 1e3 * eager_s,
                     "graph_ms": None if graph_s is None else 1e3 * graph_s,
                     "of_roofline": bound.time_s / best,
                     "achieved_gb_s": step.bytes_touched() / best / 1e9})
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# -- the run ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--gpu", help="labkit's GPU row (default: from the device's name)")
    parser.add_argument("--model", default="Llama-3-8B", help="a labkit preset, or 'tiny'")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--all-labs", action="store_true", help="also chapters 2-4's vLLM labs")
    parser.add_argument("--skip-labs", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: pass --device cpu for a dry run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu = args.gpu or (gpu_row(name) if device.type == "cuda" else "H200 SXM")
    spec = TINY if args.model == "tiny" else get_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    report: dict = {"device": name, "torch": torch.__version__, "gpu_row": gpu,
                    "model": spec.name}
    print(f"device {name} (labkit row {gpu}), torch {torch.__version__}")

    if not args.skip_labs:
        labs = run_engine_labs(args.all_labs)
        report["labs"] = [asdict(r) for r in labs]
        print("\n1. engine labs")
        for r in labs:
            print(f"  {r.lab:<28} {r.engine:<13} {r.outcome}"
                  + (f" [{r.seconds:.0f} s]" if r.seconds else ""))

    if device.type == "cuda":
        sheet = datasheet_check(gpu, device)
        report["datasheet"] = sheet
        print(f"\n2. datasheet ({gpu})\n"
              f"  copy  {sheet['copy_gb_s']:,.0f} GB/s of {sheet['datasheet_gb_s']:,.0f} "
              f"({sheet['copy_of_datasheet']:.0%})\n"
              f"  bf16  {sheet['bf16_tflops']:,.0f} TFLOP/s of "
              f"{sheet['datasheet_bf16_tflops']:,.0f} ({sheet['bf16_of_datasheet']:.0%})")

    steps = decode_roofline(spec, gpu, batch_sizes, args.context_len, device)
    report["decode"] = steps
    print(f"\n3. one decode step of {spec.name}, context {args.context_len}, bf16, against "
          f"the {gpu} roofline")
    print(f"  {'batch':>5} {'roofline ms':>11} {'eager ms':>9} {'graph ms':>9} "
          f"{'of roofline':>11} {'GB/s':>7}")
    for r in steps:
        graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.3f}"
        print(f"  {r['batch_size']:>5} {r['roofline_ms']:>11.3f} {r['eager_ms']:>9.3f} "
              f"{graph:>9} {r['of_roofline']:>11.0%} {r['achieved_gb_s']:>7,.0f}")

    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
