"""How fast the serving simulator runs: the step-by-step reference against the fast path.

    python benchmarks/simulator_speed.py

One workload: Llama-3-8B on an H100 SXM, lognormal prompts (median 500 tokens) and answers
(median 200), 20 requests/s, 256 sequences and 8192 tokens per step, prefix caching on (the
default) and off. Simulated requests per second of wall time, and of this process's CPU time
(on a shared machine the wall clock also counts other processes' turns); each fast-path figure
is the median of three runs. The goal for the fast path: 5,000 requests per second of wall time
on the 10,000 requests with prefix caching on (on a quiet machine).

The reference would take minutes on the 10,000 requests, so it runs their first 2,000
(arrivals are steady, so the rate carries over), and the fast path runs those too: the ratio
compares the same requests, whose results must be identical. Last, both paths on two small
workloads under memory pressure, one that preempts and one of multi-turn chats whose prompts
hit the prefix cache: they must agree to the bit.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from labkit.hardware import plan_kv_cache
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig
from labkit.simulate import RooflineCost, Workload, multi_turn_workload, sample_lengths, simulate
from labkit.simulate.metrics import RequestLatencies

# ``python benchmarks/simulator_speed.py`` before the fast path (the step-by-step loop only),
# on this 2-core machine on 2026-11-30: 500 requests 134/s, 2,000 requests 333/s, 5,000 249/s.
BEFORE = "134-333 requests/s (500-5,000 requests, step by step, 2026-11-30)"
# The fast path with prefix caching on, 10,000 requests, before and after the batched block
# pool and hashing on arrival (commit 068c476 against its successor), alternated on the same
# shared machine on 2026-12-01, medians of 3: 1,602 -> 2,299 requests/s of wall time (1.4x).

COST = RooflineCost("Llama-3-8B", "H100 SXM")
NUM_BLOCKS = plan_kv_cache("Llama-3-8B", "H100 SXM", max_model_len=8192).num_gpu_blocks
GOAL_REQ_S = 5000  # fast path, prefix caching on, 10,000 requests, wall time
REPEATS = 3        # fast-path runs per figure; the median is reported


def workload(n: int, rate: float = 20.0) -> list[Request]:
    """The first ``n`` requests of one fixed workload (the same seeds for any ``n``)."""
    return Workload(np.zeros(n), sample_lengths("lognormal", n, 1, mean=500, high=4000),
                    sample_lengths("lognormal", n, 2, mean=200, high=2000),
                    seed=0).at_rate(rate).requests()


def outcome(requests: list[Request], scheduler: Scheduler, result) -> tuple:
    """What must not depend on the path: every request's timings, tokens and block hashes,
    every step, and the prefix cache's counters."""
    kv = scheduler.kv_cache
    return ([(RequestLatencies.of(r), r.num_preemptions, r.token_ids, r.block_hashes)
             for r in requests], result.steps, scheduler.num_preemptions,
            kv.prefix_cache_hits, kv.block_pool.num_evictions)


def timed(n: int, fast: bool, caching: bool, keep: bool = False) -> tuple[float, float, tuple]:
    """Simulated requests per second of wall time and of CPU time, and with ``keep`` the
    run's outcome (else ``()``: a kept outcome holds every token and block hash, hundreds of
    megabytes that would slow the runs after it)."""
    scheduler = Scheduler(KVCacheManager(NUM_BLOCKS, 16, caching), SchedulerConfig(256, 8192))
    requests = workload(n)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(scheduler, requests, COST, fast=fast)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return n / wall, n / cpu, outcome(requests, scheduler, result) if keep else ()


def median_timed(n: int, caching: bool) -> tuple[float, float]:
    """The fast path's median rates over ``REPEATS`` runs."""
    runs = [timed(n, True, caching) for _ in range(REPEATS)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def agree(name: str, make, num_blocks: int) -> str:
    """Both paths on ``make()``'s requests and a cache of ``num_blocks`` blocks of 16."""
    outcomes = []
    for fast in (True, False):
        scheduler = Scheduler(KVCacheManager(num_blocks, 16), SchedulerConfig(256, 8192))
        requests = make()
        outcomes.append(outcome(requests, scheduler,
                                simulate(scheduler, requests, COST, fast=fast)))
    _, _, preemptions, hits, evictions = outcomes[0]
    return (f"{name}: {preemptions} preemptions, {hits:,} prefix-cache hit tokens, "
            f"{evictions:,} evictions; fast and reference agree: "
            f"{'yes' if outcomes[0] == outcomes[1] else 'NO'}")


def chats() -> list[Request]:
    """80 conversations of 5 turns: each prompt is the history so far, so it hits the cache."""
    return multi_turn_workload(80, 5, 200, [60, 150, 30], [120, 40, 250], 4.0, 2.0, seed=1)


def main() -> None:
    print(f"before: {BEFORE}")
    print(f"{'prefix caching':<15}{'path':<11}{'requests':>9}{'wall req/s':>12}{'CPU req/s':>11}")
    for caching in (True, False):
        label = "on" if caching else "off"
        ref_wall, ref_cpu, ref_outcome = timed(2000, fast=False, caching=caching, keep=True)
        identical = timed(2000, fast=True, caching=caching, keep=True)[2] == ref_outcome
        del ref_outcome
        fast_same = median_timed(2000, caching)
        fast_all = median_timed(10_000, caching)
        for path, n, (wall, cpu) in (("reference", 2000, (ref_wall, ref_cpu)),
                                     ("fast", 2000, fast_same), ("fast", 10_000, fast_all)):
            print(f"{label:<15}{path:<11}{n:>9,}{wall:>12,.0f}{cpu:>11,.0f}")
        print(f"{label:<15}{'fast / reference on the same 2,000 requests:':<44}"
              f"{fast_same[0] / ref_wall:>5.1f}x wall, {fast_same[1] / ref_cpu:.1f}x CPU; "
              f"identical results: {'yes' if identical else 'NO'}")
        if caching:
            print(f"{label:<15}goal on a quiet machine: {GOAL_REQ_S:,} req/s wall on 10,000 "
                  f"requests; here: {fast_all[0]:,.0f} "
                  f"({'met' if fast_all[0] >= GOAL_REQ_S else 'not met'})")
    print(agree("400 requests at 40/s, 3,000 blocks",
                lambda: workload(400, rate=40.0), 3000))
    print(agree("400 chat turns, 500 blocks", chats, 500))


if __name__ == "__main__":
    main()
