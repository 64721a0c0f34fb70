"""The tutorial's two models on one GPU (its chapter 6, multi-model sharing), as written, to hold
our numbers against (:ref:`ch06-sharing-tutorial-wrong`).

It starts Code Llama 34B and Llama 3 8B, both AWQ INT4 with ``max_model_len=4096`` and
``enforce_eager=True``, as two ``LLM`` objects on one GPU, each with
``gpu_memory_utilization = 0.95 * 0.45``. The bug: the same fraction for both models whatever
their weights and traffic, so on an A100 40GB the coder has no room for its KV cache and on an
A100 80GB memory is left unused. The fix is :func:`labkit.sharing.plan_sharing`, which sizes each
fraction from the load its model must carry; :func:`labkit.sharing.check_fractions` shows what
the tutorial's fractions do.
"""

from __future__ import annotations

from collections.abc import Mapping

from labkit.checks import in_range
from labkit.sharing import SharedModel


def tutorial_models(concurrency: Mapping[str, int] | None = None) -> list[SharedModel]:
    """The tutorial's two models as it deploys them (:ref:`ch06-sharing-two-instances`): Code Llama
    34B and Llama 3 8B, AWQ INT4, ``max_model_len=4096``, ``enforce_eager=True``; ``concurrency``
    sets the target load of each (``{"coder": 8, "chat": 16}``), one sequence by default."""
    concurrency = dict(concurrency or {})
    return [SharedModel("coder", "CodeLlama-34B", weight_dtype="int4-awq", max_model_len=4096,
                        enforce_eager=True, concurrency=concurrency.pop("coder", 1)),
            SharedModel("chat", "Llama-3-8B", weight_dtype="int4-awq", max_model_len=4096,
                        enforce_eager=True, concurrency=concurrency.pop("chat", 1))]


def tutorial_utilizations(gpu_memory_utilization: float = 0.95,
                          memory_fraction: float = 0.45) -> list[float]:
    """What the tutorial passes to each ``LLM``: ``gpu_memory_utilization * memory_fraction``
    (0.95 * 0.45 = 0.4275 for both), the same for a 34B and an 8B model; labkit's
    :func:`~labkit.sharing.plan_sharing` gives each its own."""
    in_range("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    in_range("memory_fraction", memory_fraction, 0, 1, low_open=True)
    return [gpu_memory_utilization * memory_fraction] * 2
