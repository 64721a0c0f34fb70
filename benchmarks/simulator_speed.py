"""How fast the serving simulator runs: the step-by-step reference against the fast path.

    python benchmarks/simulator_speed.py

One workload: Llama-3-8B on an H100 SXM, lognormal prompts (median 500 tokens) and answers
(median 200), 20 requests/s, 256 sequences and 8192 tokens per step, prefix caching on (the
default) and off. Simulated requests per second of wall time, and of this process's CPU time
(on a shared machine the wall clock also counts other processes' turns). The reference would
take minutes on the 10,000 requests, so it runs their first 2,000 (arrivals are steady, so the
rate carries over), and the fast path runs those too: the ratio compares the same requests.
Last, both paths on a small workload that preempts: they must agree to the bit.
"""

from __future__ import annotations

import time

from labkit.hardware import plan_kv_cache
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig
from labkit.simulate import RooflineCost, random_workload, sample_lengths, simulate
from labkit.simulate.metrics import RequestLatencies

# ``python benchmarks/simulator_speed.py`` before the fast path (the step-by-step loop only),
# on this 2-core machine on 2026-11-30: 500 requests 134/s, 2,000 requests 333/s, 5,000 249/s.
BEFORE = "134-333 requests/s (500-5,000 requests, step by step, 2026-11-30)"

COST = RooflineCost("Llama-3-8B", "H100 SXM")
NUM_BLOCKS = plan_kv_cache("Llama-3-8B", "H100 SXM", max_model_len=8192).num_gpu_blocks


def workload(n: int, rate: float = 20.0) -> list[Request]:
    """The first ``n`` requests of one fixed workload (the same seeds for any ``n``)."""
    return random_workload(n, rate, sample_lengths("lognormal", n, 1, mean=500, high=4000),
                           sample_lengths("lognormal", n, 2, mean=200, high=2000), seed=0)


def timed(n: int, fast: bool, caching: bool) -> tuple[float, float]:
    """Simulated requests per second of wall time and of CPU time."""
    scheduler = Scheduler(KVCacheManager(NUM_BLOCKS, 16, caching), SchedulerConfig(256, 8192))
    requests = workload(n)
    wall, cpu = time.perf_counter(), time.process_time()
    simulate(scheduler, requests, COST, fast=fast)
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def agree(n: int = 400) -> tuple[bool, int]:
    """Both paths on a cache small enough to preempt: per-request latencies and preemptions,
    and every step, equal. Returns the verdict and the number of preemptions."""
    runs = []
    for fast in (True, False):
        scheduler = Scheduler(KVCacheManager(3000, 16), SchedulerConfig(256, 8192))
        result = simulate(scheduler, workload(n, rate=40.0), COST, fast=fast)
        runs.append(([(RequestLatencies.of(r), r.num_preemptions) for r in result.requests],
                     result.steps, scheduler.num_preemptions))
    return runs[0] == runs[1], runs[0][2]


def main() -> None:
    print(f"before: {BEFORE}")
    print(f"{'prefix caching':<15}{'path':<11}{'requests':>9}{'wall req/s':>12}{'CPU req/s':>11}")
    for caching in (True, False):
        label = "on" if caching else "off"
        ref = timed(2000, fast=False, caching=caching)
        fast_same = timed(2000, fast=True, caching=caching)
        fast_all = timed(10_000, fast=True, caching=caching)
        for path, n, (wall, cpu) in (("reference", 2000, ref), ("fast", 2000, fast_same),
                                     ("fast", 10_000, fast_all)):
            print(f"{label:<15}{path:<11}{n:>9,}{wall:>12,.0f}{cpu:>11,.0f}")
        print(f"{label:<15}{'fast / reference on the same 2,000 requests:':<44}"
              f"{fast_same[0] / ref[0]:>5.1f}x wall, {fast_same[1] / ref[1]:.1f}x CPU")
    same, preemptions = agree()
    print(f"fast and reference agree on 400 requests with {preemptions} preemptions: "
          f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
