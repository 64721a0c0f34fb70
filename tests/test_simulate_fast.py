"""The fast simulator against the step-by-step one: the same run, to the last bit."""

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig, StaticBatchScheduler
from labkit.simulate import RooflineCost, simulate
from labkit.simulate.cost import row_totals
from labkit.simulate.fast import can_simulate_fast
from labkit.simulate.metrics import RequestLatencies
from labkit.units import cdiv


def one_second_per_step(rows):
    return 1.0  # with whole-second arrivals, arrivals land exactly on step ends


def linear_cost(rows):
    """A cost model without ``time_of_totals``: the fast path hands it every row."""
    return 0.003 + 1e-4 * sum(n for n, _ in rows) + 1e-6 * sum(c for _, c in rows)


class SlowerRoofline(RooflineCost):
    """Changes ``__call__`` only: its inherited ``time_of_totals`` no longer agrees, so the
    fast path must charge it by rows."""

    def __call__(self, rows):
        return 1.5 * super().__call__(rows)


COSTS = {"roofline": RooflineCost("Llama-3-8B", "H100 SXM", step_overhead_s=0.001),
         "slower roofline": SlowerRoofline("Qwen2.5-7B", "L4"),
         "one second": one_second_per_step, "linear": linear_cost}


@st.composite
def runs(draw):
    """A workload and an engine small enough to preempt, with prefixes worth caching.

    Token ids come from a two- or three-letter alphabet and often repeat a shared start, so
    blocks collide and prefix caching hits; some requests come again later (a twin), so a
    running request fills blocks that an earlier one left in the cache.
    """
    block_size = draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    letters = st.integers(0, draw(st.integers(1, 2)))
    shared = draw(st.lists(letters, max_size=24))
    specs = []
    for _ in range(draw(st.integers(1, 14))):
        prompt = draw(st.sampled_from([shared, []])) + draw(st.lists(letters, min_size=1,
                                                                     max_size=30))
        output = draw(st.lists(letters, min_size=1, max_size=24))
        arrival = draw(st.integers(0, 12)) * draw(st.sampled_from([1.0, 0.25, 0.013]))
        specs.append((prompt, output, arrival))
        if draw(st.integers(0, 3)) == 0:
            specs.append((prompt, output, arrival + draw(st.integers(0, 3))))
    longest = max(len(p) + len(o) - 1 for p, o, _ in specs)
    num_blocks = cdiv(longest, block_size) + draw(st.integers(0, 3 * cdiv(longest, block_size)))
    # Budgets below max_num_seqs too: then the budget, not the seats, limits the batch.
    budget = draw(st.integers(1, 5) | st.integers(1, longest + 20) if chunked
                  else st.integers(longest, longest + 20))
    config = SchedulerConfig(draw(st.integers(1, 6)), budget, chunked)
    return specs, num_blocks, block_size, draw(st.booleans()), config, draw(st.sampled_from(
        sorted(COSTS)))


# Found by a search: a decode that fills a block, and a later decode in the same step whose
# new block evicts the cached block with the same hash. Only running order gets it right.
SAME_STEP_FILL_AND_EVICT = (
    [([0, 1, 0, 1, 0], [0, 1, 0, 0], 11.0), ([0, 1, 0, 0, 1, 1, 1, 0, 1], [0, 0, 1], 1.0),
     ([0, 1, 0, 0, 1, 1, 1, 0, 1], [0, 0, 1], 3.0),
     ([1, 0, 0, 0, 0, 1, 0], [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1], 2.0),
     ([1, 0, 0, 0, 0, 1, 0], [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1], 5.0),
     ([0], [1, 0, 1, 1], 0.75), ([1, 1, 0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0, 1], 0.75)],
    8, 3, True, SchedulerConfig(2, 31, True), "one second")


def run(spec, fast):
    specs, num_blocks, block_size, caching, config, cost = spec
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    scheduler = Scheduler(kv, config)
    requests = [Request(f"r{i}", p, o, t) for i, (p, o, t) in enumerate(specs)]
    return simulate(scheduler, requests, COSTS[cost], fast=fast), scheduler


def per_request(result):
    return [(RequestLatencies.of(r), r.num_preemptions, r.token_times, r.token_ids,
             r.block_hashes, r.num_computed_tokens, r.finish_reason) for r in result.requests]


def kv_state(kv: KVCacheManager):
    pool = kv.block_pool
    return ([b.block_id for b in pool.free_queue], {v: b.block_id for v, b in pool.cached.items()},
            [(b.ref_cnt, b.generation, b.block_hash, b.parent_content_id) for b in pool.blocks],
            pool.num_evictions, kv.prefix_cache_queries, kv.prefix_cache_hits, kv.req_to_blocks)


def assert_same_run(spec):
    """Both paths on ``spec``: the same requests, steps, finishing order and KV cache; returns
    the fast run's scheduler."""
    fast, fast_scheduler = run(spec, fast=True)
    slow, slow_scheduler = run(spec, fast=False)
    assert per_request(fast) == per_request(slow)
    assert fast.steps == slow.steps  # every step: times, tokens, running, waiting, memory
    assert ([r.request_id for r in fast_scheduler.finished]
            == [r.request_id for r in slow_scheduler.finished])
    assert fast_scheduler.num_preemptions == slow_scheduler.num_preemptions
    assert kv_state(fast_scheduler.kv_cache) == kv_state(slow_scheduler.kv_cache)
    return fast_scheduler


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
@example(SAME_STEP_FILL_AND_EVICT)
def test_fast_path_is_the_step_by_step_path(spec):
    assert_same_run(spec)


@st.composite
def cached_runs_under_pressure(draw):
    """Prefix caching on and a cache too small for the load: hits, evictions and preemption.

    Half the requests draw tokens from a wide vocabulary, so none of their blocks is shared
    (the fast path offers such blocks to the cache late, when the request frees them); the
    others draw from two letters after a shared start, and some come again later, often
    while the first is still decoding (a shared hash value arrives: the fast path must then
    catch up with the blocks it has not offered yet).
    """
    block_size = draw(st.integers(2, 4))
    shared = draw(st.lists(st.integers(0, 1), min_size=block_size, max_size=12))
    scale = draw(st.sampled_from([1.0, 0.25, 0.01]))
    specs = []
    for _ in range(draw(st.integers(4, 16))):
        if draw(st.booleans()):
            letters = st.integers(0, 1)
            prompt = shared + draw(st.lists(letters, min_size=1, max_size=12))
        else:
            letters = st.integers(0, 10**6)
            prompt = draw(st.lists(letters, min_size=1, max_size=30))
        output = draw(st.lists(letters, min_size=1, max_size=20))
        arrival = draw(st.integers(0, 20)) * scale
        specs.append((prompt, output, arrival))
        if draw(st.integers(0, 2)) == 0:
            specs.append((prompt, output, arrival + draw(st.integers(1, 12)) * scale))
    longest = max(len(p) + len(o) - 1 for p, o, _ in specs)
    num_blocks = cdiv(longest, block_size) + draw(st.integers(0, cdiv(longest, block_size)))
    config = SchedulerConfig(draw(st.integers(2, 8)), draw(st.integers(longest, longest + 40)),
                             draw(st.booleans()))
    return (specs, num_blocks, block_size, True, config,
            draw(st.sampled_from(["one second", "linear"])))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cached_runs_under_pressure())
def test_fast_path_with_prefix_caching_under_memory_pressure(spec):
    assert_same_run(spec)


def test_a_run_with_hits_evictions_and_preemptions_is_the_same_by_both_paths():
    """One seeded run that is sure to have all three, so the equivalence above never rests on
    the luck of the draw: 40 requests behind a shared start or with tokens of their own, a
    third of them sent twice, into a cache of 40 blocks."""
    rng = random.Random(3)
    system = [rng.randrange(4) for _ in range(12)]
    specs = []
    for _ in range(40):
        vocab = 4 if rng.random() < 0.5 else 10**6
        start = system if vocab == 4 else []
        prompt = start + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        arrival = rng.randrange(60) * 0.25
        specs.append((prompt, output, arrival))
        if rng.random() < 1 / 3:
            specs.append((prompt, output, arrival + rng.randint(1, 8) * 0.25))
    scheduler = assert_same_run(
        (specs, 40, 4, True, SchedulerConfig(8, 256, True), "one second"))
    kv = scheduler.kv_cache
    assert kv.prefix_cache_hits > 0 and kv.block_pool.num_evictions > 0
    assert scheduler.num_preemptions > 0


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["Llama-3-8B", "Llama-3-70B", "Mixtral-8x7B"]),
       st.sampled_from(["H100 SXM", "H200 SXM", "L4"]), st.sampled_from([1, 2, 8]),
       st.sampled_from(["bf16", "fp8", "int4"]), st.sampled_from([0.0, 0.002]),
       st.lists(st.tuples(st.integers(1, 9000), st.integers(0, 200_000)), min_size=1,
                max_size=64))
def test_roofline_cost_of_totals_is_the_cost_of_rows(model, gpu, tp, dtype, overhead, rows):
    cost = RooflineCost(model, gpu, tp, weight_dtype=dtype, step_overhead_s=overhead)
    assert cost.time_of_totals(*row_totals(rows)) == cost(rows)  # equal, not approximately


def test_the_fast_path_hashes_every_block_once():
    calls = 0

    def counting_hash(key):
        nonlocal calls
        calls += 1
        return hash(key)

    # Request i: 37 prompt and 50 + i planned tokens; blocks of 4; 40 blocks cannot hold 4 of
    # them (22 to 24 blocks each), so some are preempted and recomputed, from their hashes.
    requests = [Request(f"r{i}", list(range(i, i + 37)), list(range(50 + i)), 0.5 * i)
                for i in range(6)]
    scheduler = Scheduler(KVCacheManager(40, 4, hash_fn=counting_hash), SchedulerConfig(4, 64))
    simulate(scheduler, requests, one_second_per_step)
    assert scheduler.num_preemptions > 0
    assert calls == sum((37 + 50 + i) // 4 for i in range(6))  # every full block, once
    assert [len(r.block_hashes) for r in requests] == [(87 + i) // 4 for i in range(6)]


class StopsAtSeven(Request):
    def check_stop(self) -> bool:
        if self.token_ids[-1] == 7:
            self.finish_reason = "stop"
            return True
        return super().check_stop()


def test_what_the_fast_path_leaves_to_the_step_by_step_one():
    kv = KVCacheManager(64, 4)
    plain = [Request("a", [1, 2, 3], [4, 5, 6])]
    assert can_simulate_fast(Scheduler(kv), plain)
    assert not can_simulate_fast(StaticBatchScheduler(kv, 4), plain)
    assert not can_simulate_fast(Scheduler(kv), [StopsAtSeven("a", [1], [7, 8, 9])])
    assert not can_simulate_fast(Scheduler(kv), plain + [Request("a", [1], [2])])  # same id
    # A request that stops early still stops early, by either path.
    for fast in (True, False):
        early = StopsAtSeven("s", [1, 2], [3, 7, 8, 9])
        simulate(Scheduler(KVCacheManager(64, 4)), [early], one_second_per_step, fast=fast)
        assert early.token_ids == [1, 2, 3, 7] and early.finish_reason == "stop"


def test_max_steps_stops_both_paths_alike():
    for fast in (True, False):
        with pytest.raises(RuntimeError, match="max_steps=3"):
            simulate(Scheduler(KVCacheManager(64, 4)), [Request("a", [1, 2], [3] * 5)],
                     one_second_per_step, max_steps=3, fast=fast)
