"""The teaching engine, measured in one run on one workload (chapter 2).

1. Continuous batching against one request at a time: 32 prompts, 64 tokens each.
2. The engine against ``transformers``' ``generate`` on the same tiny model (CPU torch),
   one prompt at a time and as one padded batch, greedy, same token counts.

Prints tokens/s and the ratios; nothing is asserted (machines differ, and are shared).

    python benchmarks/engine.py
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from labkit.engine import LLM, SamplingParams, write_tiny_model

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 32, 64, 64


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    model_dir = str(write_tiny_model(tempfile.mkdtemp() + "/tiny"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=PROMPT_LEN).tolist() for _ in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = NUM_PROMPTS * MAX_TOKENS
    llm = LLM(model_dir, max_num_seqs=NUM_PROMPTS, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    llm.generate(prompts[:2], params)  # warm up

    one_at_a_time = timed(lambda: [llm.generate([p], params) for p in prompts])
    continuous = timed(lambda: llm.generate(prompts, params))
    print(f"teaching engine, one request at a time: {tokens / one_at_a_time:8.0f} tok/s")
    print(f"teaching engine, continuous batching:   {tokens / continuous:8.0f} tok/s  "
          f"({one_at_a_time / continuous:.1f}x)")

    try:
        import torch
        import transformers
    except ImportError:
        print("transformers comparison skipped: install labkit[ref]")
        return
    torch.set_grad_enabled(False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = torch.tensor(prompts)  # equal lengths: no padding needed

    def hf_generate(input_ids):
        model.generate(input_ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                       do_sample=False, pad_token_id=0)

    hf_one = timed(lambda: [hf_generate(batch[i:i + 1]) for i in range(NUM_PROMPTS)])
    hf_batch = timed(lambda: hf_generate(batch))
    print(f"transformers generate, one at a time:   {tokens / hf_one:8.0f} tok/s")
    print(f"transformers generate, one batch:       {tokens / hf_batch:8.0f} tok/s")
    print(f"teaching engine (continuous) / transformers (batch): {hf_batch / continuous:.2f}x")


if __name__ == "__main__":
    main()
