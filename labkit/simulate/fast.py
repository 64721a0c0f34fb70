"""The simulator's fast path: the same steps as the step-by-step loop, far less work per step
(:ref:`ch03-simulating`).

In a busy engine most running requests are decoding, and a decode step changes each of them
in one predictable way: one more token, at the step's end. The step-by-step loop
(:func:`~labkit.simulate.simulate` with ``fast=False``) still visits every one of them every
step: its slots, its token list, its row for the cost model. Here the decoding requests at
the head of ``scheduler.running`` are *steady*, and kept lazily:

- a steady request's :class:`~labkit.scheduling.Request` is brought up to date only when
  something reads it (a full block to hash, its last token, its preemption); its tokens and
  their times then arrive as slices;
- the step's cost comes from running sums (``time_of_totals``, see
  :mod:`~labkit.simulate.cost`), not from a row per request;
- requests are bucketed by where their next token falls in a block, so a step finds the few
  that need a new block, or fill one, without scanning the batch; their block work is what
  ``KVCacheManager.allocate_slots`` does for one token, on the same tables and pool, with the
  same outcome (only the manager's counts of a steady request's slots and cached blocks
  lag: nothing reads them before the request is freed);
- with prefix caching, a request's planned tokens are known on arrival, so all its block
  hashes are computed then, in one pass (``Request.block_hashes`` runs ahead of its
  ``token_ids``, which every reader allows: lookups stop at the known tokens, and the hasher
  skips blocks already hashed);
- a steady request's last step is known the moment it becomes steady: a heap says who
  finishes when.

Everything else (the rest of ``running``, admission, picking victims, finishing) is the
scheduler's own code: :meth:`~labkit.scheduling.Scheduler.schedule_running`,
:meth:`~labkit.scheduling.Scheduler.admit_waiting`,
:meth:`~labkit.scheduling.Scheduler.preempt_last`, :meth:`~labkit.scheduling.Scheduler.update`.
Decisions, block ids, times: identical to the step-by-step loop, which a property test checks
on random workloads (``tests/test_simulate_fast.py``).
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from labkit.kvcache import BlockHash, KVCacheBlock, KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerOutput
from labkit.simulate.cost import StepCostModel, row_totals
from labkit.simulate.records import SimulationResult, StepRecord


def can_simulate_fast(scheduler: object, requests: Sequence[Request]) -> bool:
    """Whether :func:`simulate_fast` gives the step-by-step result for this run: an empty
    :class:`~labkit.scheduling.Scheduler` on a :class:`~labkit.kvcache.KVCacheManager`, and
    plain :class:`~labkit.scheduling.Request` objects with planned outputs and distinct ids
    (a subclass may stop early through ``check_stop``, which the fast path asks only of a
    request's last planned token)."""
    return (type(scheduler) is Scheduler and type(scheduler.kv_cache) is KVCacheManager
            and not scheduler.has_unfinished_requests()
            and all(type(r) is Request and r.output_plan is not None for r in requests)
            and len({r.request_id for r in requests}) == len(requests))


def simulate_fast(scheduler: Scheduler, requests: Sequence[Request], step_cost: StepCostModel,
                  max_steps: int) -> SimulationResult:
    """Run ``requests`` through ``scheduler`` exactly as :func:`~labkit.simulate.simulate`
    does step by step (check :func:`can_simulate_fast` first)."""
    sim = FastSimulator(scheduler, step_cost)
    arrivals = sorted(requests, key=lambda r: r.arrival_time)  # stable, like the event heap
    result = SimulationResult(list(requests))
    steps, kv = result.steps, scheduler.kv_cache
    times = [r.arrival_time for r in arrivals] + [float("inf")]
    i, now = 0, times[0]
    with cyclic_gc_paused():
        while True:
            while times[i] <= now:
                sim.add_request(arrivals[i])
                i += 1
            if not scheduler.has_unfinished_requests():
                if i == len(arrivals):
                    return result
                now = times[i]
                continue
            if len(steps) >= max_steps:
                raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
            end, num_tokens = sim.step(len(steps), now)
            while times[i] <= end:  # arrivals during the step come in before its record
                sim.add_request(arrivals[i])
                i += 1
            steps.append(StepRecord(now, end, num_tokens, len(scheduler.running),
                                    len(scheduler.waiting), kv.usage, scheduler.num_preemptions))
            now = end


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector for the run. A run builds millions of objects (block
    hashes, token lists) that live to its end and form no cycles: the collector would scan
    them again and again and free nothing, a third of the time with prefix caching on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # The objects made meanwhile would all wait in the youngest generation, and the first
        # collection after enable() would scan every one of them. Freezing moves them aside
        # and unfreezing puts them in the oldest generation, which is rarely collected.
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


@dataclass(eq=False, slots=True)
class _Steady:
    """A running request that decodes one token every step, kept lazily."""

    request: Request
    rank: int                   # grows along ``running``: orders block work within a step
    context_base: int           # its context (computed tokens) at step ``t`` is this + t
    synced: int                 # its Request holds every token of the steps before this one
    blocks: list[KVCacheBlock]  # its block table in the KV cache manager (the same lists)
    block_ids: list[int]
    hashes: list[BlockHash]     # its Request's block hashes (the same list)
    gone: bool = False          # finished or preempted: no longer steady


class FastSimulator:
    """The steps of one run; ``running[:len(steady)]`` are the steady requests."""

    def __init__(self, scheduler: Scheduler, step_cost: StepCostModel) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache
        self.block_size = self.kv.block_size
        self.step_cost = step_cost
        self.time_of_totals = _time_of_totals(step_cost)
        self.ends: list[float] = []  # the end time of every step so far
        self.steady: list[_Steady] = []
        # Steady requests by (tokens - step) % block_size: the bucket ``(1 - t) % block_size``
        # starts a block at step t, the bucket ``-t % block_size`` fills one.
        self.buckets: list[list[_Steady]] = [[] for _ in range(self.block_size)]
        self.finishes: list[tuple[int, int, _Steady]] = []  # heap: (last step, rank, request)
        self.context_base_sum = 0
        self.ranks = itertools.count()
        self.out = SchedulerOutput()  # what the scheduler adds to a step beyond steady decodes

    def add_request(self, request: Request) -> None:
        """``scheduler.add_request``; with prefix caching, also hash the blocks of the
        request's planned output now, in one pass: a step that fills one only looks it up."""
        self.scheduler.add_request(request)  # which hashes the prompt's full blocks
        hasher = self.kv.block_hasher
        if hasher is not None:
            hashes = request.block_hashes
            rest = request.token_ids[len(hashes) * hasher.block_size:]  # a partial block
            rest += request.output_plan[request.num_output_tokens:]
            hasher.extend_with(hashes, rest)

    def step(self, t: int, now: float) -> tuple[float, int]:
        """Schedule, time and finish step ``t`` starting at ``now``; returns its end and its
        number of tokens."""
        sched = self.scheduler
        if self.out.requests or self.out.preempted:  # most steps leave it empty: reused then
            self.out = SchedulerOutput()
        out = self.out
        # Each steady decode takes one token of the budget, and they all fit: every running
        # request got a token when it was admitted, so ``running`` never outnumbers the budget.
        if self._decode_blocks(t, out):  # else a steady request preempted itself: no more
            num_steady = len(self.steady)
            budget = sched.config.max_num_batched_tokens - num_steady
            if len(sched.running) > num_steady:
                budget = sched.schedule_running(sched.running[num_steady:], budget, out)
            if not out.preempted:  # as in Scheduler.schedule
                sched.admit_waiting(out, budget)
        num_steady = len(self.steady)
        end = now + self._cost(t, out)
        self.ends.append(end)
        if self.finishes and self.finishes[0][0] <= t:
            self._finish_steady(t, end)
        if not out.requests:  # most steps: the steady decodes only
            return end, num_steady
        sched.update(out, end)
        self._absorb(t + 1)
        return end, num_steady + out.total_num_scheduled_tokens

    def _cost(self, t: int, out: SchedulerOutput) -> float:
        """The step's time: steady decodes, rows ``(1, context)``, then ``out``'s rows."""
        n = len(self.steady)
        if self.time_of_totals is None:
            return self.step_cost([(1, s.context_base + t) for s in self.steady] + out.rows)
        contexts = self.context_base_sum + n * t
        tokens, pairs, kv_tokens = row_totals(out.rows) if out.rows else (0, 0, 0)
        return self.time_of_totals(n + tokens, contexts + n + pairs, n + contexts + kv_tokens)

    def _decode_blocks(self, t: int, out: SchedulerOutput) -> bool:
        """What ``allocate_slots`` does for this step's one-token decodes, in running order:
        a new block for each whose token starts one, preempting from the tail of ``running``
        when none is free, and, with prefix caching, the cache entry of each whose token fills
        one. Requests in the middle of a block need nothing. Returns False if a request had
        to preempt itself, which ends the step's scheduling, as in ``schedule_running``."""
        size, pool = self.block_size, self.kv.block_pool
        starting = self.buckets[(1 - t) % size]
        filling = self.buckets[-t % size] if self.kv.block_hasher is not None else []
        if filling is not starting and len(starting) <= pool.num_free_blocks:
            # No preemption this step. New blocks only evict hashes cached before the step,
            # and a filled block whose hash was not among them caches the same way before or
            # after those evictions: such blocks are cached first, the new blocks are taken
            # after, in one call. From the first filled block whose hash is cached already
            # (a twin's, or a collision), the rest goes in running order below.
            filling = self._cache_until_cached(filling, t)
            if not filling:
                for s, block in zip(starting, pool.get_new_blocks(len(starting)), strict=True):
                    s.blocks.append(block)
                    s.block_ids.append(block.block_id)
                return True
        # A copy: preemption takes requests out of the buckets.
        touched = sorted(starting + filling, key=_rank) if filling and filling is not starting \
            else list(starting)
        for s in touched:  # block_size 1: every token starts a block and fills it
            if s.gone:  # preempted earlier in this step
                continue
            context = s.context_base + t  # the token computed now is number context + 1
            if context % size == 0:
                if not pool.num_free_blocks and not self._preempt_for(s, t, out):
                    return False
                block = pool.get_new_blocks(1)[0]
                s.blocks.append(block)
                s.block_ids.append(block.block_id)
            if filling and (context + 1) % size == 0:
                self._cache_full_block(s, (context + 1) // size - 1)
        return True

    def _cache_until_cached(self, filling: list[_Steady], t: int) -> list[_Steady]:
        """Cache the blocks that ``filling`` fills at step ``t``, in running order, up to the
        first whose hash value is cached already; returns the requests from that one on."""
        pool, size = self.kv.block_pool, self.block_size
        for i, s in enumerate(filling):
            index = (s.context_base + t + 1) // size - 1
            block_hash, blocks = s.hashes[index], s.blocks
            if block_hash.value in pool.cached:
                return filling[i:]
            # _cache_full_block(s, index), one call less: a busy step fills several blocks.
            pool.cache_block(blocks[index], block_hash, blocks[index - 1] if index else None)
        return []

    def _preempt_for(self, s: _Steady, t: int, out: SchedulerOutput) -> bool:
        """Preempt from the tail of ``running`` until a block is free for ``s``; False if
        ``s`` itself had to go. A steady victim is brought up to date first."""
        sched = self.scheduler
        while not self.kv.block_pool.num_free_blocks:
            if len(sched.running) == len(self.steady):  # the tail of running is steady
                self._sync(self.steady[-1], t)
                self._remove(self.steady[-1])
            if sched.preempt_last(out) is s.request:
                return False
        return True

    def _cache_full_block(self, s: _Steady, index: int) -> None:
        """Offer block ``index`` of ``s``, just filled, to the prefix cache, under the hash
        computed on the request's arrival; the Request itself stays lazy."""
        blocks = s.blocks
        self.kv.block_pool.cache_block(blocks[index], s.hashes[index],
                                       blocks[index - 1] if index else None)

    def _sync(self, s: _Steady, t: int) -> None:
        """Bring ``s``'s Request up to date with the tokens of every step before ``t``."""
        k = t - s.synced
        if not k:
            return
        r = s.request
        done = len(r.token_ids) - r.prompt_len
        r.num_computed_tokens += k
        r.token_ids += r.output_plan[done:done + k]
        r.token_times += self.ends[s.synced:t]  # its block hashes are all known already
        s.synced = t

    def _finish_steady(self, t: int, end: float) -> None:
        """Steady requests whose last token comes from step ``t``, in running order: the
        token goes through ``record_step`` (and ``check_stop``), then their blocks are freed."""
        sched = self.scheduler
        while self.finishes and self.finishes[0][0] <= t:
            s = heapq.heappop(self.finishes)[2]
            if s.gone:  # preempted before its last step
                continue
            self._sync(s, t)
            s.request.record_step(1, end)
            self.kv.free(s.request.request_id)
            sched.running.remove(s.request)
            sched.finished.append(s.request)
            self._remove(s)

    def _remove(self, s: _Steady) -> None:
        self.steady.remove(s)
        self.buckets[(s.context_base + 1) % self.block_size].remove(s)
        self.context_base_sum -= s.context_base
        s.gone = True

    def _absorb(self, t: int) -> None:
        """Make steady, from step ``t`` on, the decoding requests that now follow the steady
        ones in ``running`` (those that just finished their prefill)."""
        running, steady = self.scheduler.running, self.steady
        while len(steady) < len(running):
            r = running[len(steady)]
            if r.num_computed_tokens != r.num_tokens - 1:
                return
            s = _Steady(r, next(self.ranks), r.num_computed_tokens - t, t,
                        self.kv.req_to_blocks[r.request_id], self.kv.req_block_ids[r.request_id],
                        r.block_hashes)
            steady.append(s)
            self.buckets[(s.context_base + 1) % self.block_size].append(s)
            last_step = t + r.max_tokens - r.num_output_tokens - 1
            heapq.heappush(self.finishes, (last_step, s.rank, s))
            self.context_base_sum += s.context_base


def _rank(s: _Steady) -> int:
    return s.rank


def _time_of_totals(step_cost: StepCostModel):
    """The cost model's ``time_of_totals`` if the class that gives it ``__call__`` gives it
    that too: a subclass that changes ``__call__`` alone is charged by its rows."""
    owner = next(k for k in type(step_cost).__mro__ if "__call__" in vars(k))
    return step_cost.time_of_totals if "time_of_totals" in vars(owner) else None
