"""Batch scheduling (:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`:
:numref:`fig-batching-timeline`; :ref:`ch03-simulating`).

- :class:`Scheduler`: continuous batching with vLLM's token budget, chunked prefill and
  preemption by recompute, over a :class:`~labkit.kvcache.KVCacheManager`.
- :class:`StaticBatchScheduler`: the tutorial's static batching, with padding and memory.
- :func:`static_decode_steps`, :func:`continuous_decode_steps`: the tutorial's own toy count.
"""

from labkit.scheduling.request import Request, RequestStatus
from labkit.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from labkit.scheduling.static import StaticBatchScheduler
from labkit.scheduling.toy import continuous_decode_steps, static_decode_steps

__all__ = ["Request", "RequestStatus", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "StaticBatchScheduler", "continuous_decode_steps", "static_decode_steps"]
