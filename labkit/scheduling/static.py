"""Static batching, the seed tutorial's baseline, with memory and padding accounted
(:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`:
:numref:`fig-batching-timeline`).

A batch of up to ``batch_size`` requests is formed only when the previous one has finished
entirely. Its prompts are padded to the longest and prefilled together; then every member
decodes in lockstep until the longest answer is done, finished members riding along as
padding. Memory is reserved up front for the padded batch, as ``transformers``' ``generate``
does, so a batch is only as large as that reservation allows.
"""

from __future__ import annotations

from collections import deque

from labkit.checks import positive_int
from labkit.hardware.kv_budget import check_sequence_fits
from labkit.kvcache import KVCacheManager
from labkit.scheduling.request import Request, RequestStatus
from labkit.scheduling.scheduler import SchedulerOutput
from labkit.units import cdiv


class StaticBatchScheduler:
    """Run-to-completion batches over the same interface as :class:`Scheduler`."""

    def __init__(self, kv_cache: KVCacheManager, batch_size: int) -> None:
        positive_int("batch_size", batch_size)
        self.kv_cache = kv_cache
        self.batch_size = batch_size
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []
        self.finished: list[Request] = []
        self.num_preemptions = 0  # static batching never preempts; kept for a common report
        self._padded_len = 0      # context per row of the current batch after the last step

    @property
    def running(self) -> list[Request]:
        return [r for r in self.batch if not r.is_finished]

    def add_request(self, request: Request) -> None:
        check_sequence_fits(self._longest(request), self.kv_cache.num_blocks,
                            self.kv_cache.block_size, f"request {request.request_id!r}")
        request.set_block_hasher(self.kv_cache.block_hasher)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            self._form_batch()
            if not self.batch:
                return out
            for request in self.batch:
                out.add(request, request.prompt_len, self._allocate(request, request.prompt_len))
            self._padded_len = max(r.prompt_len for r in self.batch)
            out.rows = [(self._padded_len, 0)] * len(self.batch)
            return out
        for request in self.running:
            out.add(request, 1, self._allocate(request, 1))
        out.rows = [(1, self._padded_len)] * len(self.batch)
        self._padded_len += 1
        return out

    def update(self, out: SchedulerOutput, now: float) -> list[Request]:
        done = [r for r in out.requests
                if r.record_step(out.num_scheduled_tokens[r.request_id], now)]
        if not self.running:  # the batch is over: release its padded reservation
            for request in self.batch:
                self.kv_cache.free(request.request_id)
            self.finished.extend(self.batch)
            self.batch = []
        return done

    def _form_batch(self) -> None:
        """Take requests while the padded reservation for the whole batch still fits."""
        self.batch = []
        longest = 0
        while self.waiting and len(self.batch) < self.batch_size:
            candidate = max(longest, self._longest(self.waiting[0]))
            blocks = cdiv(candidate, self.kv_cache.block_size) * (len(self.batch) + 1)
            if blocks > self.kv_cache.num_blocks:
                break
            longest = candidate
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.batch.append(request)

    def _allocate(self, request: Request, num_new: int) -> list[int]:
        """Slots for ``num_new`` more tokens; returns the request's block table."""
        if self.kv_cache.allocate_slots(request.request_id, request.token_ids, num_new,
                                        block_hashes=request.block_hashes) is None:
            # _form_batch reserved the padded batch; reaching this is a bug, not a user error.
            raise RuntimeError("static batch outgrew its reservation")
        return self.kv_cache.get_block_ids(request.request_id)

    @staticmethod
    def _longest(request: Request) -> int:
        return request.prompt_len + request.max_tokens - 1
