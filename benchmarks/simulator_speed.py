"""How fast the serving simulator runs: simulated requests (and steps) per wall-clock second.

    python benchmarks/simulator_speed.py
"""

from __future__ import annotations

import time

from labkit.hardware import plan_kv_cache
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Scheduler, SchedulerConfig
from labkit.simulate import RooflineCost, random_workload, sample_lengths, simulate


def main() -> None:
    blocks = plan_kv_cache("Llama-3-8B", "H100 SXM", max_model_len=8192).num_gpu_blocks
    cost = RooflineCost("Llama-3-8B", "H100 SXM")
    print(f"{'requests':>9} {'steps':>8} {'wall s':>8} {'requests/s':>11} {'steps/s':>9} "
          f"{'simulated s':>12}")
    for n in (500, 2000, 5000):
        requests = random_workload(n, 20.0, sample_lengths("lognormal", n, 1, mean=500, high=4000),
                                   sample_lengths("lognormal", n, 2, mean=200, high=2000), seed=0)
        scheduler = Scheduler(KVCacheManager(blocks, 16), SchedulerConfig(256, 8192))
        start = time.perf_counter()
        result = simulate(scheduler, requests, cost)
        wall = time.perf_counter() - start
        print(f"{n:>9} {len(result.steps):>8} {wall:>8.2f} {n / wall:>11,.0f} "
              f"{len(result.steps) / wall:>9,.0f} {result.duration_s:>12,.1f}")


if __name__ == "__main__":
    main()
