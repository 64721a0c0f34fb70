"""Allocator cost per operation from 1e3 to 1e6 blocks: labkit's free queue vs a list.

Each operation takes one block and returns another, the steady state of a serving engine. The
free queue should cost the same at every pool size; the seed tutorial's ``list.pop(0)`` grows
linearly with the pool. Prints nanoseconds per operation and the ratio to the smallest pool,
all measured in this one run.

    python benchmarks/allocator.py
"""

from __future__ import annotations

import time

from labkit.kvcache import KVCacheManager

OPS = 20_000


def per_op_ns(fn, ops: int = OPS) -> float:
    start = time.perf_counter()
    fn(ops)
    return (time.perf_counter() - start) / ops * 1e9


def manager_cycle(num_blocks: int):
    kv = KVCacheManager(num_blocks, block_size=16, enable_prefix_caching=False)
    kv.allocate_slots("warm", [0] * 16, 16)  # a long-lived request, as in a real engine

    def run(ops: int) -> None:
        tokens = [1] * 16
        for _ in range(ops):
            kv.allocate_slots("r", tokens, 16)
            kv.free("r")
    return run


def list_cycle(num_blocks: int):
    free = list(range(num_blocks))

    def run(ops: int) -> None:
        for _ in range(ops):
            free.append(free.pop(0))
    return run


def main() -> None:
    sizes = [10**3, 10**4, 10**5, 10**6]
    rows = [(n, per_op_ns(manager_cycle(n)), per_op_ns(list_cycle(n))) for n in sizes]
    base_queue, base_list = rows[0][1], rows[0][2]
    print(f"{'blocks':>9} {'KVCacheManager ns/op':>22} {'ratio':>7} "
          f"{'list.pop(0) ns/op':>19} {'ratio':>7}")
    for n, queue_ns, list_ns in rows:
        print(f"{n:>9,} {queue_ns:>22,.0f} {queue_ns / base_queue:>7.2f} "
              f"{list_ns:>19,.0f} {list_ns / base_list:>7.2f}")


if __name__ == "__main__":
    main()
