"""Load for a gateway, and what the backends say it did (chapter 5, :ref:`ch05-backend-dies`).

Lab 05 and ``benchmarks/gateway_prefix.py`` put the same fleet under the same loads:

* a **fleet** (:class:`BackendFleet`): ``labkit serve`` processes of one model on free
  loopback ports, which a lab can crash (SIGKILL, as the OOM killer would) and start again
  on the same port, and a gateway in front (:func:`start_gateway`, a ``labkit gateway``
  process; vllm-router's is :func:`labkit.gateway.vllm_router.start_router`);
* **streams** classified the way a client sees them (:func:`stream_completion`): complete,
  cut with an error event, broken (ended without ``[DONE]``), lost before the first byte, or
  shed with 429;
* **chat sessions** that resend their history every turn (:func:`chat_workload`,
  :func:`run_conversations`): the workload where prefix caching pays, because turn ``t``'s
  prompt starts with all of turn ``t - 1``'s prompt and its reply. Replies are the model's
  own (greedy), so the history is what a chat client would send;
* the **backends' own counters** (:class:`BackendCounters`): requests finished and the
  prefix-cache counters from each backend's ``/metrics`` (vLLM's names), read before and
  after a run, so the same numbers come out whichever router stood in front.

Everything that sends requests is ``async``: a notebook awaits it in its own event loop, a
script wraps it in ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from labkit.bench import BenchRequest
from labkit.checks import ParameterError, in_range, positive_int
from labkit.launch import ServeConfig, ServerProcess, command_for, free_port

#: How a streamed request can end, seen from the client.
OUTCOMES = ("complete", "cut", "broken", "lost", "shed")

# Words the chat sessions are made of (deterministic text; the tiny model answers gibberish).
_WORDS = ("requests tokens cache prefix block gateway backend stream latency batch queue "
          "prompt reply model server route replica memory decode prefill").split()


# -- one stream, as the client sees it -----------------------------------------------------

@dataclass(frozen=True)
class StreamResult:
    """How one streamed completion ended (one of :data:`OUTCOMES`), what it said, and when.

    * ``complete``: HTTP 200 and ``data: [DONE]``, no error event;
    * ``cut``: the stream ended with an error event (``data: {"error": ...}``) and then
      ``[DONE]``: the client knows its answer is incomplete;
    * ``broken``: it streamed, then ended without ``[DONE]`` (a truncated body): the client
      cannot tell an incomplete answer from a complete one except by that absence;
    * ``lost``: nothing streamed (a 5xx, a refused or dropped connection);
    * ``shed``: 429, refused on purpose (``Retry-After`` says when to come back).

    ``ttft_ms`` runs from sending to the first event that carries a choice; ``e2el_ms`` to
    the end of the stream; both are ``None`` when no token came.
    """

    outcome: str
    text: str = ""
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str,
                            max_tokens: int, *,
                            headers: Mapping[str, str] | None = None) -> StreamResult:
    """Send one greedy streamed ``/v1/completions`` request through ``client`` (its base URL
    is the gateway or server) and classify how it ended (chapter 5)."""
    positive_int("max_tokens", max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    pieces: list[str] = []
    first = None
    done, error = False, None
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=dict(headers or {})) as response:
            if response.status_code != 200:
                await response.aread()
                outcome = "shed" if response.status_code == 429 else "lost"
                return StreamResult(outcome, error=f"HTTP {response.status_code}: "
                                                   f"{response.text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"].get("message", str(event["error"]))
                elif event.get("choices"):
                    first = first or time.perf_counter()
                    pieces.append(event["choices"][0].get("text") or "")
    except httpx.HTTPError as err:
        # Streamed first, then the connection broke: broken; nothing streamed: lost.
        error = f"{type(err).__name__}: {err}"
        if first is None:
            return StreamResult("lost", error=error)
        done = False
    end = time.perf_counter()
    ttft_ms = None if first is None else 1e3 * (first - start)
    e2el_ms = None if first is None else 1e3 * (end - start)
    if error is not None and done:
        outcome = "cut"
    elif not done:
        outcome = "broken" if first is not None else "lost"
        error = error or "the stream ended without data: [DONE]"
    else:
        outcome = "complete"
    return StreamResult(outcome, "".join(pieces), ttft_ms, e2el_ms, error)


def count_outcomes(results: Sequence[StreamResult]) -> dict[str, int]:
    """``{outcome: how many}`` with every outcome of :data:`OUTCOMES`, zeros included."""
    counts = Counter(r.outcome for r in results)
    return {outcome: counts[outcome] for outcome in OUTCOMES}


# -- what the backends say ------------------------------------------------------------------

@dataclass(frozen=True)
class BackendCounters:
    """Counters from one backend's ``/metrics``, vLLM's names (chapter 5).

    ``requests``: requests finished (``vllm:e2e_request_latency_seconds_count``; vLLM's
    histogram and ``labkit serve``'s alike); ``prefix_cache_queries`` and
    ``prefix_cache_hits``: prompt tokens looked up in, and found in, its prefix cache
    (``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``). Counters start at 0 when
    the server starts: take both readings of a difference between restarts.
    """

    url: str
    requests: float
    prefix_cache_queries: float
    prefix_cache_hits: float

    def since(self, before: BackendCounters) -> BackendCounters:
        """What happened between the reading ``before`` and this one."""
        if before.url != self.url:
            raise ParameterError("before", f"before is a reading of {before.url}, "
                                           f"not of {self.url}")
        return BackendCounters(self.url, self.requests - before.requests,
                               self.prefix_cache_queries - before.prefix_cache_queries,
                               self.prefix_cache_hits - before.prefix_cache_hits)


def parse_counters(url: str, metrics_text: str) -> BackendCounters:
    """:class:`BackendCounters` from a ``/metrics`` page (summed over label sets: vLLM
    labels each engine core separately)."""
    wanted = {"vllm:e2e_request_latency_seconds_count": "requests",
              "vllm:prefix_cache_queries_total": "prefix_cache_queries",
              "vllm:prefix_cache_hits_total": "prefix_cache_hits"}
    values = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
    return BackendCounters(url, **values)


def read_counters(urls: Sequence[str], timeout_s: float = 10.0) -> list[BackendCounters]:
    """Each backend's :class:`BackendCounters`, read now from its ``/metrics``."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        return [parse_counters(url, client.get(url + "/metrics").raise_for_status().text)
                for url in urls]


def fleet_hit_rate(deltas: Sequence[BackendCounters]) -> float:
    """The fleet's prefix-cache hit rate: prompt tokens found in some backend's cache over
    prompt tokens looked up, all backends together (chapter 5)."""
    queries = sum(d.prefix_cache_queries for d in deltas)
    if queries <= 0:
        raise ParameterError("deltas", "no prompt token was looked up in these readings")
    return sum(d.prefix_cache_hits for d in deltas) / queries


# -- the fleet ------------------------------------------------------------------------------

class BackendFleet:
    """``size`` ``labkit serve`` processes of ``model`` on free loopback ports (chapter 5).

    ``max_num_seqs`` sizes each backend's running batch: one number for all, or one per
    backend (a smaller one stands in for a weaker GPU), ``None`` for the engine's default.
    Start it with :meth:`start` or ``with``; :meth:`kill` crashes one (SIGKILL to its
    process group: no graceful shutdown), :meth:`restart` starts it again on the same port,
    :meth:`stop` stops them all. Start and restart from the thread that will outlive the
    servers: :class:`~labkit.launch.ServerProcess` asks Linux to stop a server when the
    thread that started it ends.
    """

    def __init__(self, model: str, size: int = 3, *, served_model_name: str = "course-model",
                 max_model_len: int | None = 1024,
                 max_num_seqs: int | Sequence[int | None] | None = None,
                 startup_timeout_s: float = 120) -> None:
        positive_int("size", size)
        if max_num_seqs is None or isinstance(max_num_seqs, int):
            max_num_seqs = [max_num_seqs] * size
        if len(max_num_seqs) != size:
            raise ParameterError("max_num_seqs", f"max_num_seqs must be one number or {size} "
                                                 f"(one per backend), got {max_num_seqs!r}")
        ports: list[int] = []
        while len(ports) < size:  # free_port() may hand out a just-closed port twice
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.configs = [ServeConfig(model=model, served_model_name=served_model_name,
                                    port=port, max_model_len=max_model_len, max_num_seqs=seqs)
                        for port, seqs in zip(ports, max_num_seqs, strict=True)]
        self.startup_timeout_s = in_range("startup_timeout_s", startup_timeout_s, 0,
                                          low_open=True)
        self.servers: list[ServerProcess | None] = [None] * size

    @property
    def urls(self) -> list[str]:
        """The backends' base URLs, in order."""
        return [cfg.base_url for cfg in self.configs]

    @property
    def model(self) -> str:
        """The name the backends serve the model under."""
        return self.configs[0].name

    def start(self) -> BackendFleet:
        """Start every backend that is not running, one after the other."""
        for i in range(len(self.configs)):
            if not self.alive(i):
                self.restart(i)
        return self

    def alive(self, i: int) -> bool:
        """True while backend ``i``'s process runs."""
        server = self.servers[self._index(i)]
        return server is not None and server.process.poll() is None

    def kill(self, i: int) -> None:
        """Crash backend ``i``: SIGKILL to its process group, as the OOM killer would."""
        if not self.alive(i):
            raise ParameterError("i", f"backend {i} is not running")
        process = self.servers[i].process
        os.killpg(os.getpgid(process.pid), signal.SIGKILL)
        process.wait()

    def restart(self, i: int) -> None:
        """Start backend ``i`` again on its port (with empty caches and counters at 0) and
        wait until it answers ``/health``."""
        cfg = self.configs[self._index(i)]
        if self.alive(i):
            raise ParameterError("i", f"backend {i} is still running")
        self.servers[i] = ServerProcess(command_for("labkit", cfg), cfg.base_url,
                                        self.startup_timeout_s).start()

    def stop(self) -> None:
        """Stop every backend (SIGTERM, SIGKILL after a grace period)."""
        for server in self.servers:
            if server is not None:
                server.stop()

    def restart_all(self) -> None:
        """Stop every backend and start it again on its port: empty prefix caches and
        counters at 0, so that the next run owes nothing to the previous one."""
        self.stop()
        self.start()

    def _index(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.configs):
            raise ParameterError("i", f"i must be a backend index in [0, {len(self.configs)}),"
                                      f" got {i!r}")
        return i

    def __enter__(self) -> BackendFleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def gateway_command(backends: Sequence[str], strategy: str, port: int, *,
                    seed: int | None = None, host: str = "127.0.0.1") -> list[str]:
    """The ``labkit gateway`` command line in front of ``backends`` with ``strategy`` (one of
    ``labkit.gateway.STRATEGIES``), run with this Python (chapter 5)."""
    from labkit.gateway.routing import STRATEGIES

    if not backends:
        raise ParameterError("backends", "backends must name at least one server URL")
    if strategy not in STRATEGIES:
        raise ParameterError("strategy", f"strategy must be one of {', '.join(STRATEGIES)}, "
                                         f"got {strategy!r}")
    in_range("port", port, 1, 65535)
    command = [sys.executable, "-m", "labkit.cli", "gateway", "--strategy", strategy,
               "--host", host, "--port", str(port)]
    if seed is not None:
        command += ["--seed", str(seed)]
    for url in backends:
        command += ["--backend", url]
    return command


def start_gateway(backends: Sequence[str], strategy: str = "endpoint_picker", *,
                  seed: int | None = 0, port: int | None = None,
                  startup_timeout_s: float = 60) -> ServerProcess:
    """Start ``labkit gateway`` on a free loopback port and return it, started, once
    ``/health`` says a backend is routable; stop it with ``stop()`` (chapter 5)."""
    port = free_port() if port is None else port
    return ServerProcess(gateway_command(backends, strategy, port, seed=seed),
                         f"http://127.0.0.1:{port}", startup_timeout_s).start()


def gateway_workers(base_url: str) -> dict[str, dict]:
    """``labkit gateway``'s ``GET /workers`` keyed by backend URL: each backend's health,
    open requests and scraped load as the gateway sees them."""
    answer = httpx.get(base_url + "/workers", timeout=10, trust_env=False).raise_for_status()
    return {worker["url"]: worker for worker in answer.json()["workers"]}


def gateway_metrics(base_url: str) -> dict[str, dict[str, float]]:
    """``labkit gateway``'s own counters, ``{sample name: {backend URL: value}}``, e.g.
    ``["labkit_gateway_ejections_total"][url]``."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).raise_for_status().text
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "backend" in sample.labels:
                per_backend = values.setdefault(sample.name, {})
                backend = sample.labels["backend"]
                per_backend[backend] = per_backend.get(backend, 0.0) + sample.value
    return values


# -- loads ----------------------------------------------------------------------------------

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
                       concurrency: int = 8, timeout_s: float = 120) -> list[StreamResult]:
    """Stream ``requests`` to ``base_url``, ``concurrency`` at a time (a closed loop: a new
    one leaves when one ends), and return how each ended, in order."""
    positive_int("concurrency", concurrency)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        async def one(request: BenchRequest) -> StreamResult:
            async with gate:
                return await stream_completion(client, model, request.prompt,
                                               request.max_tokens)

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
    requests differ in cost, as real ones do: what a load-aware router can exploit."""
    rng = np.random.default_rng(seed)
    for name, (low, high) in (("prompt_words", prompt_words), ("max_tokens", max_tokens)):
        positive_int(name, low)
        if high < low:
            raise ParameterError(name, f"{name} must be (low, high) with high >= low, "
                                       f"got {(low, high)}")
    return [BenchRequest(" ".join(rng.choice(_WORDS, size=int(rng.integers(*prompt_words,
                                                                             endpoint=True)))),
                         int(rng.integers(*max_tokens, endpoint=True)))
            for _ in range(num_requests)]


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
        return " ".join(rng.choice(_WORDS, size=n))

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
    positive_int("concurrency", concurrency)
    positive_int("max_tokens", max_tokens)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
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
        """The fleet's prefix-cache hit rate over this run (:func:`fleet_hit_rate`)."""
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


# -- a crash in the middle of a load ----------------------------------------------------------

@dataclass(frozen=True)
class CrashRun:
    """A load during which one backend was killed: how every stream ended."""

    results: list[StreamResult]
    killed_after: int   # streams finished when the backend was killed
    duration_s: float
    outcomes: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcomes", count_outcomes(self.results))

    def errors(self, outcome: str) -> Iterator[str]:
        """The error messages of the streams that ended as ``outcome``."""
        if outcome not in OUTCOMES:
            raise ParameterError("outcome", f"outcome must be one of {OUTCOMES}, "
                                            f"got {outcome!r}")
        return (r.error for r in self.results if r.outcome == outcome and r.error)


async def _running(client: httpx.AsyncClient, url: str) -> float:
    """``vllm:num_requests_running`` of one backend; 0 if it does not answer."""
    try:
        text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "vllm:num_requests_running")


async def run_with_crash(base_url: str, fleet: BackendFleet, victim: int,
                         requests: Sequence[BenchRequest], *, concurrency: int = 8,
                         kill_after: float = 1 / 3, wait_running_s: float = 10.0,
                         timeout_s: float = 120) -> CrashRun:
    """Stream ``requests`` through the router at ``base_url`` and SIGKILL backend
    ``victim`` of ``fleet`` in the middle: once a fraction ``kill_after`` of the streams has
    finished and the victim reports a request running (a running request has streamed its
    first token, so the crash cuts a stream), or after ``wait_running_s`` more seconds if it
    never does. The victim stays dead: restart it with ``fleet.restart(victim)``
    (chapter 5)."""
    positive_int("concurrency", concurrency)
    in_range("kill_after", kill_after, 0, 1, high_open=True)
    in_range("wait_running_s", wait_running_s, 0)
    finished = 0
    killed_after = math.nan
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        async def one(request: BenchRequest) -> StreamResult:
            nonlocal finished
            async with gate:
                result = await stream_completion(client, fleet.model, request.prompt,
                                                 request.max_tokens)
            finished += 1
            return result

        async def crash() -> None:
            nonlocal killed_after
            while finished < kill_after * len(requests):
                await asyncio.sleep(0.01)
            deadline = time.monotonic() + wait_running_s
            while (time.monotonic() < deadline
                   and await _running(client, fleet.urls[victim]) < 1):
                await asyncio.sleep(0.005)
            fleet.kill(victim)
            killed_after = finished

        start = time.perf_counter()
        *results, _ = await asyncio.gather(*(one(r) for r in requests), crash())
        duration_s = time.perf_counter() - start
    return CrashRun(results, killed_after, duration_s)


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2) -> float:
    """Poll ``predicate()`` until it is true; returns the seconds waited, raises
    ``TimeoutError`` after ``timeout_s`` (ejection and re-admission take a few probes)."""
    in_range("timeout_s", timeout_s, 0)
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"still not true after {timeout_s:g} s")
        time.sleep(interval_s)
    return time.monotonic() - start


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
