"""Loads for a gateway or a router, and what each did (chapter 5, :ref:`ch05-choosing-backend`).

Two loads, each run through whichever router stands at ``base_url`` and counted by the
backends themselves (:mod:`labkit.harness.counters`), so labkit's gateway and vllm-router are
measured alike:

* **requests that differ in cost** (:func:`varied_requests`, :func:`balance_run`): what a
  load-aware router can exploit and round robin cannot;
* **chat sessions that resend their history every turn** (:func:`chat_workload`,
  :func:`prefix_run`): the workload where prefix caching pays, because turn ``t``'s prompt
  starts with all of turn ``t - 1``'s prompt and its reply. Replies are the model's own
  (greedy), so the history is what a chat client would send.

Each stream is classified as the client sees it (:func:`labkit.http.client.stream_completion`).
Everything that sends requests is ``async``: a notebook awaits it in its own event loop, a
script wraps it in ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from labkit.checks import ParameterError, in_range, positive_int
from labkit.harness.counters import BackendCounters, fleet_hit_rate, read_counters
from labkit.http.client import StreamResult, client_pool, stream_completion
from labkit.simulate import BenchRequest, Workload, sample_lengths
from labkit.simulate.prompts import WORDS


# -- requests that differ in cost ------------------------------------------------------------

@dataclass(frozen=True)
class BalanceRun:
    """One load through one router: the client's streams and each backend's share."""

    label: str
    results: list[StreamResult]
    requests_per_backend: list[int]  # finished requests, from the backends' own counters
    duration_s: float

    def ttft_ms(self, percentile: float = 50) -> float:
        """A percentile of the completed streams' TTFT (ms)."""
        in_range("percentile", percentile, 0, 100)
        ttfts = [r.ttft_ms for r in self.results if r.outcome == "complete"]
        if not ttfts:
            raise ParameterError("results", f"{self.label}: no stream completed")
        return float(np.percentile(ttfts, percentile))


async def run_requests(base_url: str, model: str, requests: Sequence[BenchRequest], *,
                       concurrency: int = 8, timeout_s: float | None = 120,
                       deadline_s: float | None = None) -> list[StreamResult]:
    """Stream ``requests`` to ``base_url``, ``concurrency`` at a time (a closed loop: a new
    one leaves when one ends), and return how each ended, in order. ``timeout_s`` bounds
    each read, ``deadline_s`` each request (then it is ``hung``)."""
    async with client_pool(base_url, concurrency, timeout_s) as (client, gate):
        async def one(request: BenchRequest) -> StreamResult:
            async with gate:
                return await stream_completion(client, model, request.prompt,
                                               request.max_tokens, deadline_s=deadline_s)

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def balance_run(label: str, base_url: str, fleet_urls: Sequence[str], model: str,
                      requests: Sequence[BenchRequest], *, concurrency: int = 8) -> BalanceRun:
    """:func:`run_requests` through the router at ``base_url``, with each backend's share
    from its own ``/metrics`` (so vllm-router and labkit's gateway are counted alike)."""
    before = await asyncio.to_thread(read_counters, fleet_urls)
    start = time.perf_counter()
    results = await run_requests(base_url, model, requests, concurrency=concurrency)
    duration_s = time.perf_counter() - start
    after = await asyncio.to_thread(read_counters, fleet_urls)
    shares = [round(a.since(b).requests) for a, b in zip(after, before, strict=True)]
    return BalanceRun(label, results, shares, duration_s)


def varied_requests(num_requests: int, seed: int = 0, *, prompt_words: tuple[int, int] = (8, 80),
                    max_tokens: tuple[int, int] = (8, 64)) -> list[BenchRequest]:
    """Prompts and output lengths drawn uniformly from the given (low, high) ranges, so
    requests differ in cost, as real ones do: what a load-aware router can exploit. A
    :class:`~labkit.simulate.Workload` of those lengths, as text of one word per token
    (:meth:`~labkit.simulate.Workload.bench_requests`)."""
    positive_int("num_requests", num_requests)
    lengths = []
    for k, (name, (low, high)) in enumerate((("prompt_words", prompt_words),
                                             ("max_tokens", max_tokens))):
        positive_int(name, low)
        if high < low:
            raise ParameterError(name, f"{name} must be (low, high) with high >= low, "
                                       f"got {(low, high)}")
        lengths.append(sample_lengths("uniform", num_requests, seed + k, low=low, high=high))
    return Workload(np.zeros(num_requests), *lengths, seed=seed,
                    description=f"{num_requests} requests of {prompt_words[0]}-"
                                f"{prompt_words[1]} words in, {max_tokens[0]}-"
                                f"{max_tokens[1]} tokens out").bench_requests()


# -- chat sessions that resend their history -------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    """One chat session: a system prompt and the user's messages, one per turn."""

    session: str
    system_prompt: str
    user_messages: tuple[str, ...]

    def prompt(self, replies: Sequence[str]) -> str:
        """The prompt of turn ``len(replies)``: the system prompt, every earlier exchange
        (user message and the model's reply), then the next user message. Turn ``t``'s
        prompt starts with turn ``t - 1``'s prompt and reply, character for character."""
        if len(replies) >= len(self.user_messages):
            raise ParameterError("replies", f"{self.session} has {len(self.user_messages)} "
                                            f"turns, got {len(replies)} replies")
        lines = [self.system_prompt]
        for user, reply in zip(self.user_messages, replies, strict=False):
            lines += [f"User: {user}", f"Assistant:{reply}"]
        lines += [f"User: {self.user_messages[len(replies)]}", "Assistant:"]
        return "\n".join(lines)


def chat_workload(num_conversations: int, turns: int, *, system_words: int = 40,
                  user_words: int = 12, shared_system_prompt: bool = True,
                  seed: int = 0) -> list[Conversation]:
    """``num_conversations`` chat sessions of ``turns`` turns, words drawn with ``seed``.

    The idea of :func:`labkit.simulate.multi_turn_workload` as text for a real server: every
    session starts with a system prompt (one shared by all, or one each) and each turn adds a
    user message of ``user_words`` words.
    """
    positive_int("num_conversations", num_conversations)
    positive_int("turns", turns)
    positive_int("system_words", system_words)
    positive_int("user_words", user_words)
    rng = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    shared = words(system_words)
    return [Conversation(f"conv-{c}", shared if shared_system_prompt else words(system_words),
                         tuple(words(user_words) for _ in range(turns)))
            for c in range(num_conversations)]


@dataclass(frozen=True)
class TurnResult:
    """One turn of one conversation: its prompt's length and how its stream ended."""

    session: str
    turn: int
    prompt_chars: int
    result: StreamResult


async def run_conversations(base_url: str, model: str, conversations: Sequence[Conversation],
                            *, max_tokens: int = 16, concurrency: int = 4,
                            session_header: str | None = None,
                            timeout_s: float = 120) -> list[TurnResult]:
    """Play every conversation turn by turn: each turn is sent once the previous one's reply
    has streamed, with that reply in the history. ``concurrency`` turns (of different
    conversations) are in flight at once. With ``session_header`` each request carries the
    session's id in that header (what consistent hashing keys on). A conversation whose turn
    does not complete stops there. Returns every turn sent, conversation by conversation."""
    positive_int("max_tokens", max_tokens)
    async with client_pool(base_url, concurrency, timeout_s) as (client, gate):
        async def talk(conversation: Conversation) -> list[TurnResult]:
            headers = {session_header: conversation.session} if session_header else None
            replies: list[str] = []
            turns: list[TurnResult] = []
            for turn in range(len(conversation.user_messages)):
                prompt = conversation.prompt(replies)
                async with gate:
                    result = await stream_completion(client, model, prompt, max_tokens,
                                                     headers=headers)
                turns.append(TurnResult(conversation.session, turn, len(prompt), result))
                if result.outcome != "complete":
                    break
                replies.append(result.text)
            return turns

        sessions = await asyncio.gather(*(talk(c) for c in conversations))
    return [turn for session in sessions for turn in session]


@dataclass(frozen=True)
class PrefixRun:
    """A chat workload through one router: the turns, and the backends' counter deltas."""

    label: str
    turns: list[TurnResult]
    deltas: list[BackendCounters]
    duration_s: float

    @property
    def hit_rate(self) -> float:
        """The fleet's prefix-cache hit rate over this run
        (:func:`~labkit.harness.counters.fleet_hit_rate`)."""
        return fleet_hit_rate(self.deltas)

    @property
    def requests_per_backend(self) -> list[int]:
        return [round(d.requests) for d in self.deltas]

    def ttft_ms(self, percentile: float = 50, *, first_turns: bool | None = None) -> float:
        """A percentile of the completed turns' TTFT (ms): all turns, or only the first
        (``first_turns=True``) or only the later ones (``False``)."""
        in_range("percentile", percentile, 0, 100)
        ttfts = [t.result.ttft_ms for t in self.turns if t.result.outcome == "complete"
                 and (first_turns is None or (t.turn == 0) == first_turns)]
        if not ttfts:
            raise ParameterError("turns", f"{self.label}: no such turn completed")
        return float(np.percentile(ttfts, percentile))


async def prefix_run(label: str, base_url: str, fleet_urls: Sequence[str], model: str,
                     conversations: Sequence[Conversation], **options) -> PrefixRun:
    """:func:`run_conversations` through the router at ``base_url`` (``options`` are its),
    with the fleet's prefix-cache counters read before and after."""
    before = await asyncio.to_thread(read_counters, fleet_urls)
    start = time.perf_counter()
    turns = await run_conversations(base_url, model, conversations, **options)
    duration_s = time.perf_counter() - start
    after = await asyncio.to_thread(read_counters, fleet_urls)
    return PrefixRun(label, turns, [a.since(b) for a, b in zip(after, before, strict=True)],
                     duration_s)


def plot_runs(runs: Sequence[BalanceRun | PrefixRun], backend_labels: Sequence[str],
              axes=None):
    """Two panels: requests each backend finished, one group of bars per run; and median
    and p90 TTFT per run (chapter 5)."""
    import matplotlib.pyplot as plt

    axes = axes if axes is not None else plt.subplots(1, 2, figsize=(11, 3.5))[1]
    x = np.arange(len(runs))
    width = 0.8 / len(backend_labels)
    for b, label in enumerate(backend_labels):
        axes[0].bar(x + (b - (len(backend_labels) - 1) / 2) * width,
                    [run.requests_per_backend[b] for run in runs], width, label=label)
    axes[0].set_ylabel("requests finished")
    axes[0].legend(fontsize="small")
    for offset, percentile in ((-0.2, 50), (0.2, 90)):
        axes[1].bar(x + offset, [run.ttft_ms(percentile) for run in runs], 0.4,
                    label=f"p{percentile}")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend(fontsize="small")
    for ax in axes:
        ax.set_xticks(x, [run.label for run in runs], rotation=20, ha="right")
    return axes
