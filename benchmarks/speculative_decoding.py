"""Speculative decoding, measured: the teaching engine and vLLM's CPU build, with and without
it, on repetitive and varied prompts, one request at a time and eight (chapter 9); n-gram
lookup, then a draft model (the target quantized to 4 bits by chapter 4's quantizer).

Each engine serves the course's tiny Llama twice (``labkit.harness.speculation``), once plain
and once with
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}'``, one server at a time (an idle vLLM
busy-polls half a core). Every request is greedy with EOS ignored, so both servers must write
the same tokens: the script checks it. It prints output tokens per second with and without,
their ratio, and the acceptance rate the server's own counters give
(``vllm:spec_decode_num_accepted_tokens_total`` over ``..._num_draft_tokens_total``).

The tiny model has random weights: greedy, it soon repeats itself, which is the case n-gram
lookup is made for, so its acceptance rates are high for any prompt. Read the speed-ups as
what lookup buys where text repeats, not as a forecast for a real model. The draft model
costs about what the target does on a CPU (same arithmetic, fewer bits only on paper), so its
rows show acceptance, which both engines should agree on, not a speed-up. Clients and servers
share this machine's cores; nothing is asserted.

    python benchmarks/speculative_decoding.py       (vLLM's part needs make vllm-env)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from labkit import lab
from labkit.harness.lab_engines import lab_model
from labkit.harness.speculation import repetitive_prompts, speculation_sweep, varied_prompts
from labkit.quant.model import quantize_checkpoint

NUM_PROMPTS, OUTPUT_LEN = 16, 64
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4}
WORKLOADS = {"repetitive": repetitive_prompts(NUM_PROMPTS), "varied": varied_prompts(NUM_PROMPTS)}


def main() -> int:
    path = lab.detect()
    engines = ["labkit"] + (["vllm"] if path.runs("vllm") != "teaching" else [])
    if len(engines) == 1:
        print("vLLM is not installed here (make vllm-env): the teaching engine only",
              file=sys.stderr)
    print(f"{NUM_PROMPTS} prompts per workload, {OUTPUT_LEN} tokens out each, greedy, EOS "
          f"ignored; n-gram: {json.dumps(SPECULATIVE_CONFIG)}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before the "
          f"run")
    with tempfile.TemporaryDirectory() as scratch:
        draft = quantize_checkpoint(lab_model("labkit", path), f"{scratch}/int4", "rtn-int4")
        configs = {"n-gram": SPECULATIVE_CONFIG,
                   "draft model (the target in 4 bits)": {
                       "method": "draft_model", "model": str(draft),
                       "num_speculative_tokens": 4}}
        for name, config in configs.items():
            for engine in engines:
                sweep = speculation_sweep(config, WORKLOADS, (1, 8), OUTPUT_LEN, wanted=engine,
                                          path=path)
                print(f"\n{name}, {sweep.label}")
                print(sweep.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
