"""The seed tutorial's batching example, in its own terms
(:doc:`chapter 3 </chapters/ch03_paged_attention_batching_parallelism>`;
:ref:`ch03-tutorial-wrong`).

The tutorial counts decode steps only: a static batch costs as many steps as its longest
output; continuous batching refills a slot the step after it frees. No prefill, no memory.
These two functions reproduce its numbers exactly, so the chapter can then show what the same
ten requests cost once prefill and KV memory are accounted for.
"""

from __future__ import annotations

from collections.abc import Sequence


def static_decode_steps(output_lens: Sequence[int], batch_size: int) -> int:
    """Steps of static batching: each batch of ``batch_size`` runs to its longest output."""
    return sum(max(output_lens[i:i + batch_size])
               for i in range(0, len(output_lens), batch_size))


def continuous_decode_steps(output_lens: Sequence[int], batch_size: int) -> int:
    """Steps of continuous batching: every step, each slot produces one token; a finished
    request's slot takes the next queued request at the following step."""
    queue, active, steps = list(output_lens), [], 0
    while queue or active:
        while len(active) < batch_size and queue:
            active.append(queue.pop(0))
        steps += 1
        active = [left - 1 for left in active if left > 1]
    return steps
