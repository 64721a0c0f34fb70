"""Speculative decoding watched step by step in the teaching engine (:ref:`ch09-inside`) and
measured on a real server, with and without it (:ref:`ch09-measured`).

:func:`trace_speculation` runs one request through a :class:`~labkit.engine.LLMEngine` that
speculates and records, step by step, the drafts it verified and the tokens it emitted.

One server plain and one with vLLM's ``--speculative-config`` serve the same greedy requests
(EOS ignored, so every request writes the same number of tokens); each run reports output
tokens per second and what the server's own counters say it drafted and accepted
(``vllm:spec_decode_*``, which vLLM and ``labkit serve`` both export). Greedy speculation must
not change a single token: :attr:`SpeculationComparison.same_output` checks it on every run.

The servers are started one at a time (:func:`~labkit.harness.lab_engines.start_lab_server`
picks vLLM on a GPU, vLLM's CPU build or the teaching engine), and stopped before the next:
an idle vLLM busy-polls half a core, and two would skew each other's timings.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from labkit.checks import ParameterError, positive_int
from labkit.engine import LLMEngine, SamplingParams
from labkit.harness.lab_engines import LAB_SERVER_DEFAULTS, start_lab_server
from labkit.http.metrics import sample_totals
from labkit.lab import LabPath, detect

#: vLLM's speculative-decoding counters (``vllm/v1/spec_decode/metrics.py``): verification
#: steps of a request that had drafts, draft tokens, and the accepted ones.
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS)

_WORDS = ("gate", "river", "copper", "lamp", "orbit", "velvet", "quartz", "meadow", "signal",
          "harbor", "pixel", "tundra", "ember", "falcon", "mosaic", "cedar")


@dataclass(frozen=True)
class SpeculativeStep:
    """One engine step of one request: the drafts it verified (none on a plain step), the
    tokens it emitted (the accepted drafts first, then the model's own token), the tokens
    whose KV the cache holds after the step, and the blocks it holds for them once the slots
    of rejected drafts were handed back (both 0 once the request finished)."""

    drafts: tuple[int, ...]
    emitted: tuple[int, ...]
    cached_tokens: int
    blocks: int

    @property
    def num_accepted(self) -> int:
        """Drafts kept: the emitted tokens before the model's own."""
        return len(self.emitted) - 1 if self.drafts else 0


def trace_speculation(engine: LLMEngine, prompt: str | Sequence[int],
                      max_tokens: int) -> list[SpeculativeStep]:
    """Run ``prompt`` alone, greedily, for ``max_tokens`` tokens on ``engine`` (started with a
    ``speculative_config``), one step at a time, and record every step that emitted a token:
    the drafts scheduled for it and what it emitted (:ref:`ch09-inside`)."""
    if engine.proposer is None:
        raise ParameterError("engine", "engine must speculate: start it with a "
                                       "speculative_config")
    positive_int("max_tokens", max_tokens)
    if engine.has_unfinished_requests():
        raise ParameterError("engine", "engine must be idle: the trace follows one request")
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True))
    request = engine.groups[request_id][0]
    steps = []
    while engine.has_unfinished_requests():
        drafts, before = tuple(request.spec_token_ids), request.num_output_tokens
        engine.step()
        if request.num_output_tokens > before:
            emitted = tuple(request.token_ids[request.prompt_len + before:])
            if request.is_finished:  # its blocks are free, its KV forgotten (or cached)
                steps.append(SpeculativeStep(drafts, emitted, 0, 0))
            else:
                blocks = engine.kv_cache.get_block_ids(request.request_id)
                steps.append(SpeculativeStep(drafts, emitted, request.num_computed_tokens,
                                             len(blocks)))
    return steps


def repetitive_prompts(n: int) -> list[str]:
    """``n`` prompts that repeat one sentence eight times: where n-gram lookup finds drafts
    (code edits, documents quoted back, templated text)."""
    positive_int("n", n)
    return [f"{i}: " + "the cat sat on the mat. " * 8 for i in range(n)]


def varied_prompts(n: int) -> list[str]:
    """``n`` prompts of 40 words in an order that does not repeat within a prompt."""
    positive_int("n", n)
    return [" ".join(_WORDS[(i * 7 + j * j * 3) % len(_WORDS)] for j in range(40))
            for i in range(n)]


@dataclass(frozen=True)
class SpeculationRun:
    """One batch of greedy requests on one server: its outputs, how long they took, and the
    increase of the server's speculative-decoding counters over the run (0 when plain)."""

    concurrency: int
    output_tokens: int
    elapsed_s: float
    outputs: tuple[str, ...]
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second over the whole run."""
        return self.output_tokens / self.elapsed_s

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens over draft tokens, vLLM's "draft acceptance rate"; None
        without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification step emits per request, the bonus token included:
        ``1 + accepted / drafts``, as vLLM logs it; None without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def _counters(base_url: str) -> dict[str, float]:
    page = httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text
    return sample_totals(page, COUNTERS)


def _complete(base_url: str, model: str, prompt: str, output_len: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True}
    answer = httpx.post(base_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    answer.raise_for_status()
    done = answer.json()
    if done["usage"]["completion_tokens"] != output_len:  # the rate would count tokens unsent
        raise RuntimeError(f"the server wrote {done['usage']['completion_tokens']} tokens, "
                           f"not {output_len}")
    return done["choices"][0]["text"]


def measure_speculation(base_url: str, model: str, prompts: Sequence[str], concurrency: int,
                        output_len: int) -> SpeculationRun:
    """Send every prompt greedily for ``output_len`` tokens, at most ``concurrency`` at a
    time, and read the speculative-decoding counters before and after."""
    positive_int("concurrency", concurrency)
    positive_int("output_len", output_len)
    if not prompts:
        raise ParameterError("prompts", "prompts must hold at least one prompt")
    before = _counters(base_url)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = tuple(pool.map(lambda p: _complete(base_url, model, p, output_len), prompts))
    elapsed = time.perf_counter() - start
    after = _counters(base_url)
    grown = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    return SpeculationRun(concurrency, len(prompts) * output_len, elapsed, outputs,
                          grown[DRAFTS], grown[DRAFT_TOKENS], grown[ACCEPTED_TOKENS])


@dataclass(frozen=True)
class SpeculationComparison:
    """The same requests on a plain server and on one that speculates."""

    workload: str
    plain: SpeculationRun
    speculative: SpeculationRun

    @property
    def speedup(self) -> float:
        """Output tokens per second with speculation over without."""
        return self.speculative.tokens_per_s / self.plain.tokens_per_s

    @property
    def same_output(self) -> bool:
        """Whether greedy speculation wrote exactly the plain server's text, request by
        request (it must)."""
        return self.speculative.outputs == self.plain.outputs


@dataclass(frozen=True)
class SpeculationSweep:
    """Both servers over every workload and concurrency, and which engine ran them, on which
    path (:meth:`labkit.lab.LabPath.runs`: ``"gpu"``, ``"cpu"`` or ``"teaching"``)."""

    engine: str
    runs: str
    speculative_config: Mapping[str, object]
    rows: tuple[SpeculationComparison, ...]

    @property
    def label(self) -> str:
        """Which engine measured, in words, for a figure's title."""
        if self.engine == "labkit":
            return "labkit serve (the teaching engine)"
        # Of the real engines, only vLLM takes --speculative-config (labkit.launch).
        return "vLLM on a GPU" if self.runs == "gpu" else "vLLM's CPU build"

    def speedups(self) -> dict[str, list[tuple[int, float]]]:
        """Each workload's (concurrency, speed-up) points, for
        ``labkit.figures.speculation.speedup_figure``."""
        points: dict[str, list[tuple[int, float]]] = {}
        for row in self.rows:
            points.setdefault(row.workload, []).append((row.speculative.concurrency,
                                                        row.speedup))
        return points

    def acceptance(self) -> dict[str, tuple[float, float]]:
        """Each workload's (draft acceptance rate, mean acceptance length) over all its runs,
        from the summed counters, for ``labkit.figures.speculation.tokens_per_step_figure``;
        workloads that never drafted are left out."""
        sums: dict[str, list[float]] = {}
        for row in self.rows:
            spec = row.speculative
            total = sums.setdefault(row.workload, [0.0, 0.0, 0.0])
            total[0] += spec.num_drafts
            total[1] += spec.num_draft_tokens
            total[2] += spec.num_accepted_tokens
        return {name: (accepted / tokens, 1 + accepted / drafts)
                for name, (drafts, tokens, accepted) in sums.items() if drafts}

    def table(self) -> str:
        """One line per workload and concurrency, as the chapter prints it."""
        lines = [f"{'workload':<12}{'at once':>8}{'plain tok/s':>13}{'spec tok/s':>12}"
                 f"{'speed-up':>10}{'accepted':>10}{'tok/step':>10}{'same text':>11}"]
        for row in self.rows:
            spec = row.speculative
            rate = "no drafts" if spec.acceptance_rate is None else f"{spec.acceptance_rate:.0%}"
            length = ("-" if spec.mean_acceptance_length is None
                      else f"{spec.mean_acceptance_length:.2f}")
            lines.append(f"{row.workload:<12}{spec.concurrency:>8}"
                         f"{row.plain.tokens_per_s:>13.1f}{spec.tokens_per_s:>12.1f}"
                         f"{row.speedup:>9.2f}x{rate:>10}{length:>10}"
                         f"{'yes' if row.same_output else 'NO':>11}")
        return "\n".join(lines)


def speculation_sweep(speculative_config: Mapping[str, object],
                      workloads: Mapping[str, Sequence[str]], concurrencies: Sequence[int],
                      output_len: int, wanted: str = "vllm",
                      path: LabPath | None = None) -> SpeculationSweep:
    """Start ``wanted`` as this machine runs it, plain, then with ``speculative_config``, and
    measure every workload at every concurrency on each (:ref:`ch09-measured`).

    A short warm-up precedes each server's runs: the first steps of a server are slow
    (allocation, compilation) and would count against whichever ran first.
    """
    if not workloads or not concurrencies:
        raise ParameterError("workloads", "workloads and concurrencies must not be empty")
    path = path or detect()
    model = LAB_SERVER_DEFAULTS["served_model_name"]
    runs: dict[bool, dict[tuple[str, int], SpeculationRun]] = {}
    engine = wanted
    for speculative in (False, True):
        options = {"speculative_config": dict(speculative_config)} if speculative else {}
        engine, cfg, server = start_lab_server(wanted, path, **options)
        try:
            warm_up = next(iter(workloads.values()))[:2]
            measure_speculation(cfg.base_url, model, warm_up, len(warm_up), output_len)
            runs[speculative] = {
                (name, c): measure_speculation(cfg.base_url, model, prompts, c, output_len)
                for name, prompts in workloads.items() for c in concurrencies}
        finally:
            server.stop()
    rows = tuple(SpeculationComparison(key[0], runs[False][key], runs[True][key])
                 for key in runs[False])
    return SpeculationSweep(engine, path.runs(engine) if engine != "labkit" else "teaching",
                            dict(speculative_config), rows)
