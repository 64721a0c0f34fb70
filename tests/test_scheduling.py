"""Schedulers: the tutorial's toy count, vLLM's token budget, chunked prefill, preemption."""

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache import KVCacheManager
from labkit.scheduling import (Request, Scheduler, SchedulerConfig, StaticBatchScheduler,
                               continuous_decode_steps, static_decode_steps)
from labkit.simulate import simulate
from labkit.units import cdiv

TUTORIAL_OUTPUTS = [10, 50, 5, 100, 3, 20, 8, 60, 15, 40]


def test_tutorial_toy_numbers():
    # Static: batches [10,50,5,100] [3,20,8,60] [15,40] -> 100 + 60 + 40 = 200 steps.
    assert static_decode_steps(TUTORIAL_OUTPUTS, 4) == 200
    # Continuous: 311 tokens over 4 slots needs >= 78 steps; the 100-token request, admitted
    # at step 1, finishes at step 100 and is the last: exactly 100.
    assert continuous_decode_steps(TUTORIAL_OUTPUTS, 4) == 100


def req(rid, prompt, output, t=0.0, base=0):
    return Request(rid, list(range(base, base + prompt)), [7] * output, t)


def run_steps(scheduler, requests):
    for r in requests:
        scheduler.add_request(r)
    outs, now = [], 0.0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        now += 1.0
        scheduler.update(out, now)
        outs.append(out)
    return outs


def test_token_budget_and_chunked_prefill():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100))
    outs = run_steps(sched, [req("long", 250, 2), req("short", 20, 3, base=1000)])
    assert outs[0].num_scheduled_tokens == {"long": 100}
    assert outs[1].num_scheduled_tokens == {"long": 100}
    assert outs[2].num_scheduled_tokens == {"long": 50, "short": 20}  # prefill + prefill
    assert outs[3].num_scheduled_tokens == {"long": 1, "short": 1}    # decode + decode
    assert all(o.total_num_scheduled_tokens <= 100 for o in outs)
    assert kv.block_pool.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=100,
                                          enable_chunked_prefill=False))
    outs = run_steps(sched, [req("a", 60, 3), req("b", 60, 1, base=500)])
    assert outs[0].num_scheduled_tokens == {"a": 60}
    assert outs[1].num_scheduled_tokens == {"a": 1, "b": 60}
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        sched.add_request(req("c", 150, 1))


def test_preemption_by_recompute_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64))
    a, b = req("a", 4, 6), req("b", 4, 6, base=100)
    outs = run_steps(sched, [a, b])
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1
    assert any(o.preempted for o in outs)
    assert a.is_finished and b.is_finished
    assert b.token_ids == list(range(100, 104)) + [7] * 6     # recompute loses nothing
    assert kv.block_pool.num_free_blocks == 4


def test_prefix_cache_skips_shared_prompt_tokens():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=1000))
    run_steps(sched, [req("a", 100, 1)])
    outs = run_steps(sched, [req("b", 100, 1)])
    assert outs[0].num_scheduled_tokens == {"b": 100 - 96}   # six full blocks hit


def test_request_that_can_never_fit_is_refused():
    sched = Scheduler(KVCacheManager(num_blocks=2, block_size=4))
    with pytest.raises(ValueError, match="more than the cache's 2 blocks"):
        sched.add_request(req("x", 8, 4))
    with pytest.raises(ValueError, match="max_tokens of request 'y' must be an integer") as err:
        Request("y", [1], [])
    assert err.value.param == "max_tokens"
    with pytest.raises(ValueError, match="max_num_seqs must be a positive"):
        SchedulerConfig(max_num_seqs=0)


def test_static_batch_pads_and_waits_for_the_longest():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    sched = StaticBatchScheduler(kv, batch_size=2)
    outs = run_steps(sched, [req("a", 10, 2), req("b", 30, 5, base=100), req("c", 5, 1, base=200)])
    assert outs[0].rows == [(30, 0), (30, 0)]              # prompts padded to 30
    # 1 prefill + 4 decodes for batch [a, b]; a finished after its first decode and rides
    # along as padding; then c alone: 1 prefill.
    assert len(outs) == 6
    assert outs[2].rows == [(1, 31), (1, 31)] and list(outs[2].num_scheduled_tokens) == ["b"]
    assert kv.block_pool.num_free_blocks == 64


def test_static_batch_is_limited_by_its_padded_reservation():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    sched = StaticBatchScheduler(kv, batch_size=8)
    for i in range(4):
        sched.add_request(req(f"r{i}", 40, 40, base=100 * i))  # 79 tokens: 5 blocks each
    out = sched.schedule()
    assert len(out.requests) == 2


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20)), min_size=1,
                     max_size=12),
       blocks=st.integers(6, 30), budget=st.integers(8, 128), seqs=st.integers(1, 6),
       chunked=st.booleans(), shared=st.booleans())
def test_every_request_finishes_with_its_tokens_and_nothing_leaks(lens, blocks, budget, seqs,
                                                                  chunked, shared):
    kv = KVCacheManager(num_blocks=blocks, block_size=4)
    sched = Scheduler(kv, SchedulerConfig(seqs, budget, chunked))
    requests = [req(f"r{i}", p, o, t=0.5 * i, base=0 if shared else 1000 * i)
                for i, (p, o) in enumerate(lens)]
    runnable = []
    for r in requests:
        try:
            sched.check_request(r)
            runnable.append(r)
        except ValueError:
            pass  # refused up front: it could never run on this cache and budget
    if not runnable:
        return
    steps = []

    def cost(rows):
        steps.append(sum(n for n, _ in rows))
        return 1.0

    simulate(sched, runnable, cost)
    assert all(n <= budget for n in steps)
    for r in runnable:
        assert r.is_finished and r.num_output_tokens == r.max_tokens
        assert r.token_times == sorted(r.token_times) and r.token_times[0] > r.arrival_time
    assert kv.block_pool.num_free_blocks == blocks and not kv.req_to_blocks


def test_each_step_carries_the_block_tables_of_its_requests():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8))
    for r in (req("a", 10, 3), req("b", 3, 2, base=100)):
        sched.add_request(r)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.block_ids == {r.request_id: kv.get_block_ids(r.request_id)
                                 for r in out.requests}
        for r in out.requests:  # room for every token computed by the end of this step
            n = r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
            assert len(out.block_ids[r.request_id]) == cdiv(n, 4)
        sched.update(out, 1.0)


@dataclass(eq=False)
class StopTokenRequest(Request):
    """What an engine's request adds: a stop token, checked after the base length limit."""

    stop_token_id: int = -1

    def check_stop(self) -> bool:
        if super().check_stop():
            return True
        if self.token_ids[-1] == self.stop_token_id:
            self.finish_reason, self.stop_reason = "stop", self.stop_token_id
            return True
        return False


def test_check_stop_is_the_one_place_that_ends_a_request():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv)
    long = StopTokenRequest("long", [1, 2, 3], max_tokens=10, stop_token_id=9)
    short = StopTokenRequest("short", [4, 5], max_tokens=2, stop_token_id=9)
    gone = Request("gone", [6, 7], max_tokens=5)
    for r in (long, short, gone):
        sched.add_request(r)
    assert sched.update(sched.schedule(), 1.0, {"long": 5, "short": 5, "gone": 5}) == []
    sched.finish_request(gone, 1.5)                                  # the client went away
    done = sched.update(sched.schedule(), 2.0, {"long": 9, "short": 9})
    assert done == [long, short] and not sched.has_unfinished_requests()
    assert (long.finish_reason, long.stop_reason, long.token_ids[3:]) == ("stop", 9, [5, 9])
    assert (short.finish_reason, short.stop_reason) == ("length", None)  # length comes first
    assert (gone.finish_reason, gone.finish_time) == ("abort", 1.5)
    assert kv.block_pool.num_free_blocks == 16


def prefill(sched, request):
    """Add ``request`` and run steps until its prompt is computed."""
    sched.add_request(request)
    while request.num_computed_tokens < request.prompt_len:
        sched.update(sched.schedule(), 1.0)


def test_fork_shares_the_prompt_and_copies_its_partial_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv)
    parent = req("p", 10, 3)                             # 2 full blocks and 2 tokens
    prefill(sched, parent)
    child = Request("c", parent.prompt_token_ids, [8, 8, 8])
    assert not child.append_output_token(8, 1.0)        # its own first token, same logits
    copies = sched.fork_request(parent, child)
    p_ids, c_ids = kv.get_block_ids("p"), kv.get_block_ids("c")
    assert p_ids[:2] == c_ids[:2] and copies == [(p_ids[2], c_ids[2])]
    assert [kv.block_pool.blocks[i].ref_cnt for i in p_ids] == [2, 2, 1]
    assert child in sched.running and child.num_computed_tokens == 10
    assert child.block_hashes == parent.block_hashes    # hashed with the same hasher
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p": 1, "c": 1}  # the child decodes at once
    sched.update(out, 2.0)
    run_steps(sched, [])
    assert parent.token_ids[10:] == [7, 7, 7] and child.token_ids[10:] == [8, 8, 8]
    assert kv.block_pool.num_free_blocks == 16 and not kv.req_to_blocks


def test_fork_without_room_makes_the_child_wait_and_recompute():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv)
    parent = req("p", 14, 2)                             # 3 full blocks and 2 tokens: all 4
    prefill(sched, parent)
    child = Request("c", parent.token_ids, [8])          # the parent's own first token too
    assert sched.fork_request(parent, child) == [] and sched.waiting[0] is child
    outs = run_steps(sched, [])
    # Once the parent is done, the child takes its 3 full cached blocks and computes the rest.
    assert [o.num_scheduled_tokens for o in outs] == [{"p": 1}, {"c": 15 - 12}]
    assert child.is_finished and child.token_ids[14:] == [7, 8]
    assert kv.block_pool.num_free_blocks == 4


def test_fork_respects_max_num_seqs_and_refuses_a_stranger():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=1))
    parent = req("p", 6, 2)
    prefill(sched, parent)
    with pytest.raises(ValueError, match="must begin with the 6 computed tokens"):
        sched.fork_request(parent, req("x", 6, 2, base=50))
    child = Request("c", parent.token_ids, [8])
    assert sched.fork_request(parent, child) == [] and list(sched.waiting) == [child]
    assert "c" not in kv.req_to_blocks


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 2)),
                     min_size=1, max_size=6),
       blocks=st.integers(8, 24), seqs=st.integers(1, 6), shared=st.booleans())
def test_forked_requests_finish_with_their_tokens_and_nothing_leaks(lens, blocks, seqs, shared):
    kv = KVCacheManager(num_blocks=blocks, block_size=4)
    sched = Scheduler(kv, SchedulerConfig(seqs, 32))
    requests, children, num_children = [], [], {}
    for i, (p, o, n) in enumerate(lens):
        r = req(f"r{i}", p, o, base=0 if shared else 1000 * i)
        try:
            sched.add_request(r)
        except ValueError:
            continue  # could never fit this cache
        requests.append(r)
        num_children[r.request_id] = n
    now = 0.0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        now += 1.0
        sched.update(out, now)
        for parent in out.requests:  # fork right after the step that ends a prefill
            if parent.num_output_tokens != 1:
                continue
            for k in range(num_children.pop(parent.request_id, 0)):
                child = Request(f"{parent.request_id}.{k}", parent.prompt_token_ids,
                                [8] * (parent.max_tokens + k))  # may outlive its parent
                if child.append_output_token(8, now):  # its first token may end it
                    children.append(child)
                    continue
                try:
                    sched.fork_request(parent, child)
                except ValueError:  # longer than the whole cache: refused, as any request
                    continue
                children.append(child)
    for r in requests + children:
        assert r.is_finished and r.token_ids == r.prompt_token_ids + list(r.output_plan)
    assert kv.block_pool.num_free_blocks == blocks and not kv.req_to_blocks
