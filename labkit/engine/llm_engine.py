"""The teaching engine: scheduler, paged KV cache, model and sampler in one loop (ch. 2.1).

``LLMEngine.step()`` is one iteration of a serving engine: ask the scheduler
(:class:`labkit.scheduling.Scheduler`) for a batch, run the model on it, sample a token for
every sequence whose known tokens are all computed, check stop conditions, and report what
changed. ``LLM`` wraps it in vLLM's offline API. The KV cache is sized the way vLLM sizes it
(chapter 1.3), on a simulated device of ``device_memory_gib``.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.engine.constraints import RegexConstraint
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from labkit.engine.sampling import SamplingParams, sample
from labkit.engine.tokenizer import Tokenizer
from labkit.hardware import ModelSpec, activation_bytes, kv_cache_bytes_per_token
from labkit.kvcache import KVCacheManager
from labkit.scheduling import Request, Scheduler, SchedulerConfig
from labkit.units import GiB

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """vLLM's engine flags, by the same names, plus the size of the simulated device."""

    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    device_memory_gib: float = 0.125
    seed: int = 0


@dataclass
class _Tracked:
    request: Request
    params: SamplingParams
    prompt: str | None
    rng: np.random.Generator
    metrics: RequestMetrics
    constraint: RegexConstraint | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""


class LLMEngine:
    """A continuous-batching inference engine over a paged KV cache, in NumPy."""

    def __init__(self, args: EngineArgs) -> None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {args.gpu_memory_utilization}")
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"model: {args.model!r} is not a model directory with config.json")
        self.args = args
        config = json.loads((model_dir / "config.json").read_text())
        spec = ModelSpec.from_hf_config(config)
        self.max_model_len = args.max_model_len or spec.max_position_embeddings or 2048
        # The cache is sized from the loaded weights' bytes, so it is allocated after loading.
        self.model = LlamaModel.load(model_dir, num_blocks=1, block_size=args.block_size)
        self.num_gpu_blocks = self._size_kv_cache(spec)
        self.model.allocate_kv_cache(self.num_gpu_blocks, args.block_size)
        self.tokenizer = Tokenizer(model_dir)
        self._token_texts: list[str] | None = None  # for regex constraints, built on first use
        self.kv_cache = KVCacheManager(self.num_gpu_blocks, args.block_size,
                                       args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill))
        self.requests: dict[str, _Tracked] = {}
        self._seeds = np.random.SeedSequence(args.seed)
        self._ids = itertools.count()
        self.last_step_logits: dict[str, np.ndarray] = {}
        self.num_prompt_tokens = 0       # counters behind vLLM's Prometheus metrics
        self.num_generation_tokens = 0

    def _size_kv_cache(self, spec: ModelSpec) -> int:
        """vLLM's rule (chapter 1.3): what is left of the budget, in whole blocks."""
        args = self.args
        budget = args.device_memory_gib * GiB * args.gpu_memory_utilization
        activations = activation_bytes(spec, args.max_num_batched_tokens, args.max_num_seqs,
                                       act_dtype_bytes=4)
        block_bytes = args.block_size * kv_cache_bytes_per_token(spec, "fp32")
        num_blocks = int((budget - self.model.weight_bytes - activations) // block_bytes)
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {self.max_model_len} KV tokens but "
                f"only {max(num_blocks, 0) * args.block_size} fit in {budget / GiB:.2f} GiB; "
                f"raise device_memory_gib or gpu_memory_utilization, or lower max_model_len")
        logger.info("GPU KV cache size: %d tokens", num_blocks * args.block_size)
        return num_blocks

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        if not token_ids:
            raise ValueError("prompt: the prompt must not be empty")
        if any(not 0 <= t < self.model.spec.vocab_size for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.model.spec.vocab_size})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(token_ids)} in the prompt, "
                f"{params.max_tokens} for the completion).")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = time.monotonic()
        request = Request(request_id, token_ids, arrival_time=now, max_tokens=params.max_tokens)
        seed = params.seed if params.seed is not None else self._seeds.spawn(1)[0]
        constraint = None
        if params.regex is not None:
            if self._token_texts is None:
                self._token_texts = [self.tokenizer.decode([t], skip_special_tokens=True)
                                     for t in range(self.tokenizer.vocab_size)]
            constraint = RegexConstraint(params.regex, self._token_texts,
                                         self.tokenizer.eos_token_id)
        self.scheduler.add_request(request)
        self.requests[request_id] = _Tracked(request, params, text, np.random.default_rng(seed),
                                             RequestMetrics(now), constraint)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (a client that went away)."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            self.scheduler.finish_request(tracked.request, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that got a token."""
        out = self.scheduler.schedule()
        if not out.requests:
            return []
        now = time.monotonic()
        for request in out.requests:
            metrics = self.requests[request.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                self.requests[request.request_id].num_cached_tokens = request.num_computed_tokens
        batch = [SequenceBatch(request.token_ids[request.num_computed_tokens:
                                                 request.num_computed_tokens + n],
                               request.num_computed_tokens,
                               self.kv_cache.get_block_ids(request.request_id))
                 for request, n in zip(out.requests, out.num_scheduled_tokens.values(),
                                       strict=True)]
        logits = self.model.forward(batch)
        self.last_step_logits = {r.request_id: rows for r, rows
                                 in zip(out.requests, logits, strict=True)}
        sampled = {}
        for request, rows in zip(out.requests, logits, strict=True):
            n = out.num_scheduled_tokens[request.request_id]
            if request.num_computed_tokens + n == request.num_tokens:
                tracked = self.requests[request.request_id]
                allowed = tracked.constraint.allowed(tracked.text) if tracked.constraint else None
                sampled[request.request_id] = sample(rows[-1], tracked.params, tracked.rng,
                                                     allowed)
            if request.num_output_tokens == 0:
                self.num_prompt_tokens += n
        now = time.monotonic()
        self.scheduler.update(out, now, sampled)
        self.num_generation_tokens += len(sampled)
        return [self._advance(self.requests[rid], token, now) for rid, token in sampled.items()]

    def _advance(self, tracked: _Tracked, token: int, now: float) -> RequestOutput:
        request, params = tracked.request, tracked.params
        tracked.metrics.first_token_time = tracked.metrics.first_token_time or now
        tracked.metrics.last_token_time = now
        outputs = request.token_ids[request.prompt_len:]
        eos = self.tokenizer.eos_token_id
        ends = not params.ignore_eos or tracked.constraint is not None  # a match may end here
        if token in params.stop_token_ids or (token == eos and ends):
            tracked.finish_reason, tracked.stop_reason = "stop", None if token == eos else token
        tracked.text = self.tokenizer.decode(outputs)
        for stop in params.stop:
            cut = tracked.text.find(stop)
            if cut != -1:
                tracked.text = tracked.text[:cut]
                tracked.finish_reason, tracked.stop_reason = "stop", stop
                break
        if tracked.finish_reason is None and request.num_output_tokens >= params.max_tokens:
            tracked.finish_reason = "length"
        if tracked.finish_reason is not None:
            self.scheduler.finish_request(request, now)  # no-op when max_tokens ended it
            tracked.metrics.finished_time = now
            del self.requests[request.request_id]
        return RequestOutput(
            request.request_id, tracked.prompt, list(request.prompt_token_ids),
            [CompletionOutput(0, tracked.text, list(outputs), tracked.finish_reason,
                              tracked.stop_reason)],
            tracked.finish_reason is not None, tracked.metrics, tracked.num_cached_tokens,
            [token])


class LLM:
    """vLLM's offline API over the teaching engine: ``LLM(model=...).generate(...)``."""

    def __init__(self, model: str, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: give one per prompt, or a single one")
        engine = self.llm_engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids), use_tqdm)
        while len(finished) < len(ids):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    progress.update(1)
        progress.close()
        return [finished[i] for i in ids]

    def chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate a reply to one conversation, rendered with the model's chat template."""
        prompt = self.llm_engine.tokenizer.apply_chat_template(messages)
        ids = self.llm_engine.tokenizer.encode(prompt)
        return self.generate([ids], sampling_params, use_tqdm)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="Processed prompts")
