"""Workloads for the serving simulator (:ref:`ch03-simulating`).

Arrivals follow ``vllm bench serve``: gaps drawn from a gamma distribution with shape
``burstiness`` and mean ``1 / request_rate``; burstiness 1 is a Poisson process, lower is
burstier. Lengths are fixed, uniform or long-tailed (log-normal, like chat traffic). Token ids
are random, except where a workload shares prefixes on purpose (multi-turn conversations), so
prefix caching hits exactly where it should.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from labkit.checks import in_range, positive_int
from labkit.scheduling import Request

VOCAB_SIZE = 32000


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Arrival times in seconds; ``request_rate=inf`` sends everything at t = 0."""
    positive_int("num_requests", num_requests, at_least=0)
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf for all at once), got {request_rate}")
    in_range("burstiness", burstiness, 0, low_open=True)
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1 / (request_rate * burstiness), size=num_requests)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def sample_lengths(kind: str, num: int, seed: int = 0, *, mean: float = 256,
                   low: int = 1, high: int | None = None, sigma: float = 1.0) -> np.ndarray:
    """Token lengths: ``fixed`` (all ``mean``), ``uniform`` in [low, high], or ``lognormal``
    with median ``mean`` and shape ``sigma`` (long-tailed), clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        lengths = np.full(num, mean)
    elif kind == "uniform":
        if high is None or high < low:
            raise ValueError("uniform lengths need high >= low")
        lengths = rng.integers(low, high + 1, size=num)
    elif kind == "lognormal":
        lengths = rng.lognormal(math.log(mean), sigma, size=num)
    else:
        raise ValueError(f"kind must be 'fixed', 'uniform' or 'lognormal', got {kind!r}")
    return np.clip(np.rint(lengths), low, high).astype(int)


def random_workload(num_requests: int, request_rate: float, prompt_lens: Sequence[int],
                    output_lens: Sequence[int], burstiness: float = 1.0,
                    seed: int = 0) -> list[Request]:
    """Requests with random token ids, the given lengths, and gamma arrivals."""
    if not len(prompt_lens) == len(output_lens) == num_requests:
        raise ValueError("prompt_lens and output_lens need num_requests entries each")
    rng = np.random.default_rng(seed)
    times = arrival_times(num_requests, request_rate, burstiness, seed)
    return [Request(f"req-{i}", rng.integers(VOCAB_SIZE, size=p).tolist(),
                    rng.integers(VOCAB_SIZE, size=o).tolist(), float(t))
            for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, times, strict=True))]


def multi_turn_workload(num_conversations: int, turns: int, system_prompt_len: int,
                        user_lens: Sequence[int], output_lens: Sequence[int],
                        conversation_rate: float, think_time_s: float, seed: int = 0,
                        shared_system_prompt: bool = True) -> list[Request]:
    """Chat sessions: each turn's prompt is the whole history plus a new user message.

    All conversations share one system prompt (or each has its own). ``user_lens`` and
    ``output_lens`` give the turn lengths, cycling; turn ``t`` arrives ``t * think_time_s``
    after its conversation starts. Requests are returned in arrival order.
    """
    rng = np.random.default_rng(seed)
    starts = arrival_times(num_conversations, conversation_rate, 1.0, seed)
    system = rng.integers(VOCAB_SIZE, size=system_prompt_len).tolist()
    requests, k = [], 0
    for c, start in enumerate(starts):
        history = system if shared_system_prompt else rng.integers(
            VOCAB_SIZE, size=system_prompt_len).tolist()
        for t in range(turns):
            user = rng.integers(VOCAB_SIZE, size=user_lens[k % len(user_lens)]).tolist()
            answer = rng.integers(VOCAB_SIZE, size=output_lens[k % len(output_lens)]).tolist()
            prompt = history + user
            requests.append(Request(f"conv-{c}-turn-{t}", prompt, answer,
                                    float(start + t * think_time_s)))
            history = prompt + answer
            k += 1
    return sorted(requests, key=lambda r: r.arrival_time)


def load_trace(path: str | Path, seed: int = 0) -> list[Request]:
    """Requests from a trace file: CSV or JSON lines with ``arrival_time`` (s),
    ``prompt_len`` and ``output_len``. Token ids are random (traces rarely ship text)."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(f))
        else:
            rows = [json.loads(line) for line in f if line.strip()]
    try:
        times = [float(r["arrival_time"]) for r in rows]
        prompts = [int(r["prompt_len"]) for r in rows]
        outputs = [int(r["output_len"]) for r in rows]
    except KeyError as err:
        raise ValueError(f"trace {path.name}: every row needs {err.args[0]!r}") from None
    rng = np.random.default_rng(seed)
    return [Request(f"trace-{i}", rng.integers(VOCAB_SIZE, size=p).tolist(),
                    rng.integers(VOCAB_SIZE, size=o).tolist(), t)
            for i, (t, p, o) in enumerate(zip(times, prompts, outputs, strict=True))]
