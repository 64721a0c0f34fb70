"""Continuous vs static batching on one Poisson workload: the throughput ratio, one run.

Llama-3-8B on one A100 80GB (roofline step costs), 1,000 requests at 10 requests/s with
long-tailed prompt and output lengths; both schedulers share the KV capacity vLLM would get.

    python benchmarks/batching.py
"""

from __future__ import annotations

import numpy as np

from labkit.hardware import plan_kv_cache
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Scheduler, SchedulerConfig, StaticBatchScheduler
from labkit.simulate import RooflineCost, Workload, sample_lengths, simulate

N, RATE = 1000, 10.0


def workload():
    return Workload(np.zeros(N), sample_lengths("lognormal", N, 1, mean=400, high=4000),
                    sample_lengths("lognormal", N, 2, mean=200, high=2000),
                    seed=42).at_rate(RATE).requests()


def main() -> None:
    blocks = plan_kv_cache("Llama-3-8B", "A100 80GB", max_model_len=8192).num_gpu_blocks
    cost = RooflineCost("Llama-3-8B", "A100 80GB")
    results = {
        "static (batch 64)": simulate(StaticBatchScheduler(KVCacheManager(blocks, 16), 64),
                                      workload(), cost).summary(),
        "continuous": simulate(Scheduler(KVCacheManager(blocks, 16), SchedulerConfig(256, 2048)),
                               workload(), cost).summary(),
    }
    for name, s in results.items():
        print(f"{name:<18} {s.output_throughput:8.0f} output tok/s  {s.request_throughput:6.2f} "
              f"req/s  median TTFT {s.median_ttft_ms:10.0f} ms  median TPOT "
              f"{s.median_tpot_ms:6.1f} ms")
    ratio = results["continuous"].output_throughput / results["static (batch 64)"].output_throughput
    print(f"continuous / static output throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
