"""The teaching engine, measured in one run on one workload (chapter 2).

A 25M-parameter Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1536, written
by :func:`labkit.engine.write_tiny_model`), 32 prompts of 64 random tokens, 64 output tokens
each, greedy, prefix caching off:

1. Continuous batching (all 32 submitted at once) against one request at a time.
2. The engine against ``transformers``' ``generate`` (CPU torch, float32) on the same model and
   workload, at batch 8 (the engine then runs at most 8 sequences too) and batch 32.
3. The engine against real vLLM's CPU build (``make vllm-env``; bfloat16, its compiled
   kernels), all 32 at once, when that environment exists.

Prints tokens/s and ratios, with the figures measured before the batched forward pass beside
them; nothing is asserted (machines differ, and are shared).

    python benchmarks/engine.py
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from labkit import lab
from labkit.engine import LLM, SamplingParams, write_tiny_model

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 64, 64
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_attention_heads=8,
             num_key_value_heads=2)
# The same workload before the batched forward pass (one attention call per sequence and
# layer, walking blocks one by one), on this 2-core machine, 2026-11-30 (issue 10).
BEFORE = {"one": 76, "continuous": 168, "batching": 2.2, "hf8": 0.80, "hf32": 0.44,
          "vllm": 570, "of_vllm": 0.29}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    model_dir = str(write_tiny_model(tempfile.mkdtemp() + "/llama-25m", **SHAPE))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, size=PROMPT_LEN).tolist() for _ in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = NUM_PROMPTS * MAX_TOKENS

    def engine(max_num_seqs: int) -> LLM:
        llm = LLM(model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                  enable_prefix_caching=False, device_memory_gib=1)
        llm.generate(prompts[:2], params)  # warm up
        return llm

    llm = engine(NUM_PROMPTS)
    one = tokens / timed(lambda: [llm.generate([p], params) for p in prompts])
    continuous = tokens / timed(lambda: llm.generate(prompts, params))
    llm8 = engine(8)
    batch8 = tokens / timed(lambda: llm8.generate(prompts, params))
    print(f"teaching engine, one request at a time: {one:7.0f} tok/s   (before {BEFORE['one']})")
    print(f"teaching engine, 32 at once:            {continuous:7.0f} tok/s   "
          f"(before {BEFORE['continuous']})")
    print(f"continuous batching / one at a time:    {continuous / one:7.1f}x       "
          f"(before {BEFORE['batching']}x, goal >= 4x)")
    compare_transformers(model_dir, prompts, tokens, batch8, continuous)
    compare_vllm(model_dir, prompts, params, tokens, continuous)


def compare_transformers(model_dir: str, prompts: list[list[int]], tokens: int,
                         ours8: float, ours32: float) -> None:
    try:
        import torch
        import transformers
    except ImportError:
        print("transformers comparison skipped: install labkit[ref]")
        return
    torch.set_grad_enabled(False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def generate(batch_size: int) -> float:
        def run():
            for first in range(0, len(prompts), batch_size):
                model.generate(ids[first:first + batch_size], max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        return tokens / timed(run)

    generate(8)  # warm up
    for batch_size, ours, before in ((8, ours8, "hf8"), (32, ours32, "hf32")):
        theirs = generate(batch_size)
        print(f"transformers generate, batch {batch_size:<2}:       {theirs:7.0f} tok/s; "
              f"teaching engine at {batch_size} sequences: {ours / theirs:.2f}x "
              f"(before {BEFORE[before]}x, goal >= 1.0x at batch 8)")


def compare_vllm(model_dir: str, prompts: list[list[int]], params: SamplingParams,
                 tokens: int, ours: float) -> None:
    python = lab.detect().vllm_cpu_python
    if python is None:
        print("vLLM comparison skipped: no vLLM CPU environment (make vllm-env)")
        return
    from labkit.vllm_cpu import RemoteLLM

    vllm = RemoteLLM(python, model=model_dir, max_num_seqs=NUM_PROMPTS,
                     enable_prefix_caching=False, max_model_len=1024)
    try:
        vllm.generate(prompts[:2], params)  # warm up (compiles kernels for these shapes)
        theirs = tokens / timed(lambda: vllm.generate(prompts, params))
    finally:
        vllm.close()
    print(f"vLLM (CPU build), 32 at once:           {theirs:7.0f} tok/s   "
          f"(before {BEFORE['vllm']})")
    print(f"teaching engine / vLLM:                 {ours / theirs:7.2f}x       "
          f"(before {BEFORE['of_vllm']}x, goal >= 0.5x)")


if __name__ == "__main__":
    main()
