"""N-gram speculative decoding, measured: the teaching engine and vLLM's CPU build, with and
without it, on repetitive and varied prompts, one request at a time and eight (chapter 9).

Each engine serves the course's tiny Llama twice, once plain and once with
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}'``, one server at a time (an idle vLLM
busy-polls half a core). Every request is greedy with EOS ignored, so both servers must write
the same tokens: the script checks it. It prints output tokens per second with and without,
their ratio, and the acceptance rate the server's own counters give
(``vllm:spec_decode_num_accepted_tokens_total`` over ``..._num_draft_tokens_total``).

The tiny model has random weights: greedy, it soon repeats itself, which is the case n-gram
lookup is made for, so its acceptance rates are high for any prompt. Read the speed-ups as
what lookup buys where text repeats, not as a forecast for a real model. Clients and servers
share this machine's cores; nothing is asserted.

    python benchmarks/speculative_decoding.py       (vLLM's part needs make vllm-env)
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from labkit import lab, vllm_cpu
from labkit.harness.lab_engines import lab_model
from labkit.http.metrics import sample_totals
from labkit.launch import ServeConfig, command_for, vllm_command
from labkit.process import ServerProcess, free_port

MODEL = "course-model"
NUM_PROMPTS, OUTPUT_LEN = 16, 64
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4}
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
WORDS = ("gate", "river", "copper", "lamp", "orbit", "velvet", "quartz", "meadow", "signal",
         "harbor", "pixel", "tundra", "ember", "falcon", "mosaic", "cedar")

#: Prompts by workload: a phrase said over and over, and words in no order that repeats.
WORKLOADS = {
    "repetitive": [f"{i}: " + "the cat sat on the mat. " * 8 for i in range(NUM_PROMPTS)],
    "varied": [" ".join(WORDS[(i * 7 + j * j * 3) % len(WORDS)] for j in range(40))
               for i in range(NUM_PROMPTS)],
}


def complete(base_url: str, prompt: str) -> str:
    """One greedy completion of OUTPUT_LEN tokens; its text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0,
            "ignore_eos": True}
    answer = httpx.post(base_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    answer.raise_for_status()
    done = answer.json()
    if done["usage"]["completion_tokens"] != OUTPUT_LEN:
        raise RuntimeError(f"{done['usage']['completion_tokens']} tokens, not {OUTPUT_LEN}")
    return done["choices"][0]["text"]


def run(base_url: str, prompts: list[str], concurrency: int) -> tuple[float, list, dict]:
    """Output tokens per second over the prompts, at most ``concurrency`` at a time; the
    outputs; the spec-decode counters' increase over the run."""
    def counters() -> dict[str, float]:
        page = httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text
        return sample_totals(page, [DRAFTS, ACCEPTED])

    before = counters()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda p: complete(base_url, p), prompts))
    elapsed = time.perf_counter() - start
    after = counters()
    return (len(prompts) * OUTPUT_LEN / elapsed, outputs,
            {name: after.get(name, 0.0) - before.get(name, 0.0) for name in (DRAFTS, ACCEPTED)})


def serve_and_measure(engine: str, path: lab.LabPath, speculative: bool) -> dict:
    extra = ("--speculative-config", json.dumps(SPECULATIVE_CONFIG)) if speculative else ()
    cfg = ServeConfig(model=lab_model(engine, path), served_model_name=MODEL, port=free_port(),
                      max_model_len=1024, extra_args=extra)
    if engine == "vllm":
        server = ServerProcess(vllm_cpu.server_command(path.vllm_cpu_python, vllm_command(cfg)),
                               cfg.base_url, env=vllm_cpu.cpu_env())
    else:
        server = ServerProcess(command_for("labkit", cfg), cfg.base_url)
    print(f"starting {engine} {'with' if speculative else 'without'} speculation ...",
          flush=True)
    results = {}
    with server:
        run(cfg.base_url, WORKLOADS["varied"][:2], 2)  # warm-up: the first steps are slow
        for workload, prompts in WORKLOADS.items():
            for concurrency in (1, 8):
                results[workload, concurrency] = run(cfg.base_url, prompts, concurrency)
    return results


def main() -> int:
    path = lab.detect()
    engines = ["labkit"] + (["vllm"] if path.runs("vllm") == "cpu" else [])
    if len(engines) == 1:
        print("vLLM's CPU build is not installed here (make vllm-env): the teaching engine "
              "only", file=sys.stderr)
    print(f"{NUM_PROMPTS} prompts per workload, {OUTPUT_LEN} tokens out each, greedy, EOS "
          f"ignored; speculation: {json.dumps(SPECULATIVE_CONFIG)}")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before the "
          f"run")
    print(f"\n{'engine':<8}{'workload':<12}{'at once':>8}{'plain tok/s':>13}"
          f"{'spec tok/s':>12}{'speed-up':>10}{'accepted':>10}{'same out':>10}")
    for engine in engines:
        plain = serve_and_measure(engine, path, speculative=False)
        spec = serve_and_measure(engine, path, speculative=True)
        for key, (plain_rate, plain_out, _) in plain.items():
            spec_rate, spec_out, counts = spec[key]
            accepted = (f"{counts[ACCEPTED] / counts[DRAFTS]:.0%}" if counts.get(DRAFTS)
                        else "no drafts")
            print(f"{engine:<8}{key[0]:<12}{key[1]:>8}{plain_rate:>13.1f}{spec_rate:>12.1f}"
                  f"{spec_rate / plain_rate:>9.2f}x{accepted:>10}"
                  f"{'yes' if spec_out == plain_out else 'NO':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
