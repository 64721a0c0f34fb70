"""Workloads: the requests to send, one record for every user (:ref:`ch03-simulating`).

A :class:`Workload` is three arrays with one entry per request: arrival time (seconds),
prompt length and output length (tokens). The simulator (chapter 3), the autoscaling fleet
(chapter 5), the capacity search (chapter 6) and the benchmark of a real server (chapter 2)
all take one. It has two views: ``Workload.requests()``, the scheduler's requests with
random token ids, and ``Workload.bench_requests()``, prompts as text for an HTTP server
(of exactly the workload's lengths, given the server's tokenizer, as ``vllm bench serve``
makes them; one word per token without one).

Arrivals follow ``vllm bench serve``: gaps drawn from a gamma distribution with shape
``burstiness`` and mean ``1 / request_rate`` (:func:`arrival_times`); burstiness 1 is a
Poisson process, lower is burstier. Lengths are fixed, uniform, long-tailed (log-normal, like
chat traffic, :func:`sample_lengths`) or drawn by vLLM's random-dataset rule
(:func:`random_lengths`, :func:`random_dataset`); a production trace keeps its own
(:mod:`labkit.simulate.traces`). Token ids are random, except where a
workload shares prefixes on purpose (``prefix_len``, :func:`multi_turn_workload`), so prefix
caching hits exactly where it should.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from labkit.checks import ParameterError, in_range, positive_int
from labkit.scheduling import Request
from labkit.simulate.prompts import (WORDS, TokenizerLike, exact_length_text,
                                     ordinary_token_ids, special_tokens_added)

VOCAB_SIZE = 32000


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Arrival times in seconds, as ``vllm bench serve`` sends (:ref:`ch03-simulating`);
    ``request_rate=inf`` sends everything at t = 0."""
    positive_int("num_requests", num_requests, at_least=0)
    if not request_rate > 0:
        raise ParameterError("request_rate", f"request_rate must be > 0 (inf for all at "
                                             f"once), got {request_rate}")
    in_range("burstiness", burstiness, 0, low_open=True)
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1 / (request_rate * burstiness), size=num_requests)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def sample_lengths(kind: str, num: int, seed: int = 0, *, mean: float = 256,
                   low: int = 1, high: int | None = None, sigma: float = 1.0) -> np.ndarray:
    """Token lengths (:ref:`ch03-simulating`): ``fixed`` (all ``mean``), ``uniform`` in
    [low, high], or ``lognormal`` with median ``mean`` and shape ``sigma`` (long-tailed),
    clipped to [low, high]."""
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        lengths = np.full(num, mean)
    elif kind == "uniform":
        if high is None or high < low:
            raise ParameterError("high", f"high must be >= low ({low}) for uniform lengths, "
                                         f"got {high}")
        lengths = rng.integers(low, high + 1, size=num)
    elif kind == "lognormal":
        lengths = rng.lognormal(math.log(mean), sigma, size=num)
    else:
        raise ParameterError("kind", f"kind must be 'fixed', 'uniform' or 'lognormal', "
                                     f"got {kind!r}")
    return np.clip(np.rint(lengths), low, high).astype(int)


def random_length_bounds(input_len: int, output_len: int, range_ratio: float = 0.0
                         ) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((input low, input high), (output low, output high))``, inclusive: the ranges that
    ``vllm bench serve --dataset-name random`` draws lengths from (:ref:`ch03-simulating`).

    vLLM's rule (``get_sampling_params`` in ``vllm/benchmarks/datasets/utils.py``, vLLM 0.32):
    ``floor(len * (1 - range_ratio))`` to ``ceil(len * (1 + range_ratio))``, the output's
    low end at least 1; a prompt range that reaches 0 tokens is refused. vLLM first subtracts
    the special tokens its tokenizer adds (a BOS for Llama) from ``input_len``; labkit's
    prompts carry none, so here ``input_len`` is the prompt as sent.
    """
    positive_int("input_len", input_len)
    positive_int("output_len", output_len)
    in_range("range_ratio", range_ratio, 0, 1, high_open=True)
    input_low = math.floor(input_len * (1 - range_ratio))
    if input_low < 1:
        raise ParameterError("input_len", f"input_len must be at least 1 token after "
                                          f"range_ratio {range_ratio:g}, got the range "
                                          f"{input_low}..{input_len}")
    input_high = math.ceil(input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    return (input_low, input_high), (output_low, output_high)


def random_lengths(rng: np.random.Generator, num_requests: int, input_len: int = 1024,
                   output_len: int = 128, range_ratio: float = 0.0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths drawn as vLLM's random dataset draws them
    (:ref:`ch03-simulating`): uniform integers within :func:`random_length_bounds`, all the
    prompts' first, then all the outputs', from ``rng``. With vLLM's seed (``--seed``, the
    dataset's ``numpy.random.default_rng``) they are vLLM's lengths exactly. Its defaults:
    1024 in, 128 out, ``range_ratio`` 0 (``--random-input-len``, ``--random-output-len``,
    ``--random-range-ratio``)."""
    positive_int("num_requests", num_requests, at_least=0)
    (input_low, input_high), (output_low, output_high) = random_length_bounds(
        input_len, output_len, range_ratio)
    return (rng.integers(input_low, input_high + 1, size=num_requests),
            rng.integers(output_low, output_high + 1, size=num_requests))


@dataclass(frozen=True)
class BenchRequest:
    """One request as a real server gets it (:ref:`ch02-benchmarking`): the prompt's text
    and how many tokens to ask for (``max_tokens``). ``Workload.bench_requests()`` makes
    them."""

    prompt: str
    max_tokens: int
    #: The tokens the server counts for ``prompt`` (``usage.prompt_tokens``, special tokens
    #: included) where the prompt was made with its tokenizer; None for the words view.
    prompt_tokens: int | None = None


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests to send (:ref:`ch03-simulating`; chapters 2, 5 and 6 take the same record).

    ``arrival_s`` (seconds, sorted, from 0), ``prompt_lens`` and ``output_lens`` (tokens, at
    least 1) hold one entry per request; they are stored as read-only arrays. ``duration_s``
    is the window the workload covers (a trace of an hour whose last request comes earlier;
    default: the last arrival). ``seed`` draws the views' token ids and words, and the
    arrivals of :meth:`at_rate`. The first ``prefix_len`` tokens of request ``i`` are
    shared prefix ``i % num_prefixes`` (a system prompt, a document asked about many times);
    the rest is random. ``description`` says in words what it is, for tables.

    Equal contents make equal workloads (and the same hash), so a cached search
    (:func:`labkit.cost.capacity.max_rate_at_slo`) recognises a workload built twice.
    """

    arrival_s: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    duration_s: float | None = None
    seed: int = 0
    prefix_len: int = 0
    num_prefixes: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        for name, dtype in (("arrival_s", float), ("prompt_lens", int), ("output_lens", int)):
            values = np.array(getattr(self, name), dtype=dtype).reshape(-1)
            values.setflags(write=False)
            object.__setattr__(self, name, values)
        n = len(self.arrival_s)
        if not len(self.prompt_lens) == len(self.output_lens) == n:
            raise ParameterError("prompt_lens", "arrival_s, prompt_lens and output_lens must "
                                                "have one entry per request")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.arrival_s[0] < 0):
            raise ParameterError("arrival_s", "arrival_s must be sorted and >= 0")
        if np.any(self.prompt_lens < 1) or np.any(self.output_lens < 1):
            raise ParameterError("prompt_lens", "prompt_lens and output_lens must be >= 1 "
                                                "token each")
        last = float(self.arrival_s[-1]) if n else 0.0
        duration = last if self.duration_s is None else self.duration_s
        object.__setattr__(self, "duration_s", float(in_range("duration_s", duration, last)))
        positive_int("seed", self.seed, at_least=0)
        positive_int("num_prefixes", self.num_prefixes)
        positive_int("prefix_len", self.prefix_len, at_least=0)
        if n and self.prefix_len > self.prompt_lens.min():
            raise ParameterError("prefix_len", f"prefix_len must be <= every prompt length "
                                               f"({self.prompt_lens.min()}), got "
                                               f"{self.prefix_len}")

    # -- building one -----------------------------------------------------------------------

    @classmethod
    def fixed(cls, prompt_len: int, output_len: int, num_requests: int = 200, *,
              seed: int = 0) -> Workload:
        """Every request ``prompt_len`` tokens in, ``output_len`` out, all at t = 0 (vLLM's
        random dataset with ``range_ratio`` 0; give it a rate with :meth:`at_rate`)."""
        positive_int("num_requests", num_requests)
        positive_int("prompt_len", prompt_len)
        positive_int("output_len", output_len)
        return cls(np.zeros(num_requests), np.full(num_requests, prompt_len),
                   np.full(num_requests, output_len), seed=seed,
                   description=f"{num_requests} requests of {prompt_len} in / "
                               f"{output_len} out")

    @classmethod
    def lognormal(cls, median_prompt_len: int, median_output_len: int,
                  num_requests: int = 200, *, max_prompt_len: int, max_output_len: int,
                  sigma: float = 1.0, seed: int = 0) -> Workload:
        """Long-tailed lengths like chat traffic (:func:`sample_lengths`), clipped at the
        maxima, all at t = 0."""
        positive_int("num_requests", num_requests)
        prompts = sample_lengths("lognormal", num_requests, seed, mean=median_prompt_len,
                                 high=max_prompt_len, sigma=sigma)
        outputs = sample_lengths("lognormal", num_requests, seed + 1, mean=median_output_len,
                                 high=max_output_len, sigma=sigma)
        return cls(np.zeros(num_requests), prompts, outputs, seed=seed,
                   description=f"{num_requests} requests, lognormal lengths, median "
                               f"{median_prompt_len} in / {median_output_len} out")

    def at_rate(self, request_rate: float, burstiness: float = 1.0) -> Workload:
        """The same requests arriving at ``request_rate`` per second (``inf``: all at
        t = 0), gamma gaps of shape ``burstiness`` drawn with the workload's seed
        (:func:`arrival_times`)."""
        return replace(self, arrival_s=arrival_times(len(self), request_rate, burstiness,
                                                     self.seed), duration_s=None)

    def scaled_to_rate(self, request_rate: float) -> Workload:
        """The same arrivals with every gap (and ``duration_s``) scaled by one factor, so
        that ``len(self) / duration_s`` is ``request_rate`` per second: a trace's bursts kept
        at another load, where :meth:`at_rate` would draw new gaps (:ref:`ch03-traces`)."""
        in_range("request_rate", request_rate, 0, low_open=True)
        if not math.isfinite(request_rate):
            raise ParameterError("request_rate", "request_rate must be finite: use "
                                                 "at_rate(inf) for everything at once")
        if len(self) == 0 or self.duration_s == 0:
            raise ParameterError("request_rate", "a workload whose requests all arrive at "
                                                 "t = 0 has no rate to scale: use at_rate")
        factor = len(self) / self.duration_s / request_rate
        return replace(self, arrival_s=self.arrival_s * factor,
                       duration_s=self.duration_s * factor)

    # -- what it holds ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __getitem__(self, index: slice) -> Workload:
        """The requests ``index`` selects (a slice), as a workload: ``workload[:8]``."""
        if not isinstance(index, slice):
            raise ParameterError("index", f"index must be a slice, got {index!r}")
        return replace(self, arrival_s=self.arrival_s[index],
                       prompt_lens=self.prompt_lens[index],
                       output_lens=self.output_lens[index], duration_s=None)

    @property
    def num_requests(self) -> int:
        return len(self)

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean(self.prompt_lens))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean(self.output_lens))

    @property
    def longest(self) -> int:
        """Tokens of the longest request, prompt and output."""
        return int(np.max(self.prompt_lens + self.output_lens, initial=0))

    def rate(self, bin_s: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
        """Offered load (chapter 5): ``(bin start times, requests per second in each bin)``
        over ``duration_s``."""
        in_range("bin_s", bin_s, 0, low_open=True)
        edges = np.arange(0.0, self.duration_s + bin_s, bin_s)
        counts, _ = np.histogram(self.arrival_s, edges)
        return edges[:-1], counts / bin_s

    # -- its two views ----------------------------------------------------------------------

    def requests(self) -> list[Request]:
        """The simulator's view (:ref:`ch03-simulating`): one
        :class:`~labkit.scheduling.Request` per entry, ``req-0``, ``req-1``, ..., with random
        token ids (the shared prefixes first), arriving at ``arrival_s``."""
        rng = np.random.default_rng(self.seed)
        prefixes = [rng.integers(VOCAB_SIZE, size=self.prefix_len).tolist()
                    for _ in range(self.num_prefixes if self.prefix_len else 0)]
        requests = []
        for i, (t, p, o) in enumerate(zip(self.arrival_s, self.prompt_lens, self.output_lens,
                                          strict=True)):
            prompt = rng.integers(VOCAB_SIZE, size=p - self.prefix_len).tolist()
            if prefixes:
                prompt = prefixes[i % self.num_prefixes] + prompt
            requests.append(Request(f"req-{i}", prompt, rng.integers(VOCAB_SIZE, size=o).tolist(),
                                    float(t)))
        return requests

    def bench_requests(self, tokenizer: TokenizerLike | None = None) -> list[BenchRequest]:
        """The benchmark's view (:ref:`ch02-benchmarking`): each prompt as text (the shared
        prefixes first) and its output length as ``max_tokens``.

        Given the server's ``tokenizer``, each prompt is exactly as many tokens as the
        workload says, by the server's count (special tokens included), made as
        ``vllm bench serve`` makes its random dataset (:mod:`labkit.simulate.prompts`).
        Without one, a prompt is one word per token, which the server counts as it
        tokenizes them (about 2.5 tokens a word on the course's tiny Llama).
        """
        rng = np.random.default_rng(self.seed)
        if tokenizer is None:
            prefixes = [rng.choice(WORDS, size=self.prefix_len).tolist()
                        for _ in range(self.num_prefixes if self.prefix_len else 0)]
            requests = []
            for i, (p, o) in enumerate(zip(self.prompt_lens, self.output_lens, strict=True)):
                words = rng.choice(WORDS, size=p - self.prefix_len).tolist()
                if prefixes:
                    words = prefixes[i % self.num_prefixes] + words
                requests.append(BenchRequest(" ".join(words), int(o)))
            return requests
        added, pool = special_tokens_added(tokenizer), ordinary_token_ids(tokenizer)
        prefixes = [exact_length_text(tokenizer, rng.choice(pool, size=self.prefix_len),
                                      self.prefix_len, rng, pool)[1]
                    for _ in range(self.num_prefixes if self.prefix_len else 0)]
        requests = []
        for i, (p, o) in enumerate(zip(self.prompt_lens, self.output_lens, strict=True)):
            own = max(0, int(p) - added - self.prefix_len)  # room for BOS, as vLLM leaves it
            ids = (prefixes[i % self.num_prefixes] if prefixes else []) \
                + rng.choice(pool, size=own).tolist()
            text, encoded = exact_length_text(tokenizer, ids, len(ids), rng, pool)
            requests.append(BenchRequest(text, int(o), len(encoded) + added))
        return requests

    # -- equality on contents ---------------------------------------------------------------

    @cached_property
    def _key(self) -> tuple:
        return (self.arrival_s.tobytes(), self.prompt_lens.tobytes(),
                self.output_lens.tobytes(), self.duration_s, self.seed, self.prefix_len,
                self.num_prefixes, self.description)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Workload) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


def random_dataset(num_requests: int, input_len: int = 1024, output_len: int = 128,
                   range_ratio: float = 0.0, *, seed: int = 0) -> Workload:
    """``vllm bench serve --dataset-name random`` (:ref:`ch02-benchmarking`): lengths drawn
    by vLLM's rule (:func:`random_lengths`) with ``seed``, every request at t = 0 (give
    them a rate with :meth:`Workload.at_rate`)."""
    prompts, outputs = random_lengths(np.random.default_rng(seed), num_requests, input_len,
                                      output_len, range_ratio)
    spread = f" +-{range_ratio:.0%}" if range_ratio else ""
    return Workload(np.zeros(num_requests), prompts, outputs, seed=seed,
                    description=f"{num_requests} random requests of {input_len} in / "
                                f"{output_len} out{spread}")


def shared_prefix_dataset(num_requests: int, prefix_len: int, suffix_len: int,
                          output_len: int, num_prefixes: int = 1, *,
                          seed: int = 0) -> Workload:
    """Prompts that start with one of ``num_prefixes`` shared prefixes of ``prefix_len``
    tokens, then ``suffix_len`` of their own (:ref:`ch02-benchmarking`): a prefix-cache
    workload, every request at t = 0."""
    positive_int("num_requests", num_requests)
    positive_int("prefix_len", prefix_len)
    positive_int("suffix_len", suffix_len, at_least=0)
    positive_int("output_len", output_len)
    return Workload(np.zeros(num_requests), np.full(num_requests, prefix_len + suffix_len),
                    np.full(num_requests, output_len), seed=seed, prefix_len=prefix_len,
                    num_prefixes=num_prefixes,
                    description=f"{num_requests} requests sharing {num_prefixes} prefix(es) "
                                f"of {prefix_len} tokens")


def multi_turn_workload(num_conversations: int, turns: int, system_prompt_len: int,
                        user_lens: Sequence[int], output_lens: Sequence[int],
                        conversation_rate: float, think_time_s: float, seed: int = 0,
                        shared_system_prompt: bool = True) -> list[Request]:
    """Chat sessions (:ref:`ch03-simulating`): each turn's prompt is the whole history plus a
    new user message, so it is a list of requests, not a :class:`Workload` (whose prompts
    share at most a fixed prefix).

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
