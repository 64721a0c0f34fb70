"""The teaching engine: scheduler, paged KV cache, model and sampler in one loop
(:doc:`chapter 2 </chapters/ch02_engines>`).

``LLMEngine.step()`` is one iteration of a serving engine: ask the scheduler
(:class:`labkit.scheduling.Scheduler`) for a batch and the block table of every request in
it, run the model, sample a token for every sequence whose known tokens are all computed,
and let each request's ``check_stop`` decide whether it is done. :class:`~labkit.engine.LLM`
(:mod:`labkit.engine.llm`) wraps it in vLLM's offline API (:ref:`ch02-offline-api`); each step
leaves its records for the metrics in ``last_stats`` (:mod:`labkit.engine.stats`). The KV cache
is sized the way vLLM sizes it (chapter 1), on a simulated device of ``device_memory_gib``.

Requests enter in two halves so that a server can keep its engine loop busy only with
stepping: :meth:`~labkit.engine.LLMEngine.process_inputs` validates and tokenizes (any thread;
every problem is a :class:`~labkit.checks.ParameterError` naming the field) and
:meth:`~labkit.engine.LLMEngine.add_processed` queues the result (the engine's thread; cannot fail
on input). ``n > 1`` choices share the prompt's KV blocks: the first choice prefills, the
others fork from it (:ref:`ch03-paged-attention`) and sample their first token from the same logits.

Sharing a device (:ref:`ch06-sharing-two-instances`): with ``device_id`` the simulated device is a
:class:`~labkit.engine.device.SimulatedDevice` that other processes share, and the engine
starts only if ``gpu_memory_utilization`` of the whole device is free, as vLLM's does. With
``enable_sleep_mode`` it can :meth:`~labkit.engine.LLMEngine.sleep` (hand its weights and KV cache
back to the device) and :meth:`~labkit.engine.LLMEngine.wake_up`, as vLLM's sleep mode does.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.checks import ParameterError, in_range, positive_int
from labkit.engine.constraints import RegexConstraint
from labkit.engine.detokenizer import IncrementalDetokenizer
from labkit.engine.device import SimulatedDevice
from labkit.engine.inputs import (check_token_ids, encode_prompt, max_tokens_for,
                                  resolve_max_model_len)
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.outputs import RequestOutput
from labkit.engine.request import EngineRequest
from labkit.engine.draft_model import make_proposer
from labkit.engine.speculative import SpeculativeConfig, propose_drafts, verify
from labkit.engine.stats import (NO_LOOKUPS, EngineStats, IterationStats, PrefixCacheStats,
                                 SchedulerStats, SpecDecodingStats)
from labkit.engine.sampling import (
    RequestOutputKind,
    SamplingParams,
    logprobs_of,
    rng_for,
    sample,
)
from labkit.engine.tokenizer import Tokenizer
from labkit.hardware import (
    ModelSpec,
    activation_bytes,
    check_sequence_fits,
    kv_cache_bytes_per_token,
    num_kv_blocks,
)
from labkit.kvcache import KVCacheManager
from labkit.kvcache.block_pool import BlockPool
from labkit.scheduling import Scheduler, SchedulerConfig
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
    device_id: str | None = None  # a device shared with other processes (chapter 6.2)
    enable_sleep_mode: bool = False
    # vLLM's --speculative-config: a SpeculativeConfig, or its JSON object or text
    speculative_config: SpeculativeConfig | Mapping[str, object] | str | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  SpeculativeConfig):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        in_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        in_range("device_memory_gib", self.device_memory_gib, 0, low_open=True)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive_int(name, getattr(self, name))
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)


#: What sleep hands back to the device, by vLLM's allocator tags; ``activations`` (the memory
#: that stays in use: CUDA graphs, the allocator's cache) is kept.
SLEEP_TAGS = ("weights", "kv_cache")


class LLMEngine:
    """A continuous-batching inference engine over a paged KV cache, in NumPy."""

    def __init__(self, args: EngineArgs) -> None:
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise ParameterError("model", f"model: {args.model!r} is not a model directory "
                                          f"with config.json")
        self.args = args
        spec = ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        self.max_model_len = resolve_max_model_len(args.max_model_len, spec)
        self.device: SimulatedDevice | None = None
        if args.device_id is not None:
            # vLLM checks free memory before it loads anything (Worker.init_device).
            self.device = SimulatedDevice(args.device_id, int(args.device_memory_gib * GiB),
                                          label=f"{model_dir.name} (pid {os.getpid()})")
            try:
                self.device.request_memory(args.gpu_memory_utilization)
            except ValueError:
                self.device.release()
                raise
        # The cache is sized from the loaded weights' bytes, so it is allocated after loading.
        self.model = LlamaModel.load(model_dir, num_blocks=1, block_size=args.block_size)
        self.num_gpu_blocks = self._size_kv_cache(spec)
        self.model.allocate_kv_cache(self.num_gpu_blocks, args.block_size)
        self._device_bytes = {
            "weights": self.model.weight_bytes,
            "activations": int(self._activation_bytes(spec)),
            "kv_cache": self.num_gpu_blocks * self._block_bytes(spec)}
        if self.device is not None:
            try:
                for tag, num_bytes in self._device_bytes.items():
                    self.device.allocate(tag, num_bytes)
            except RuntimeError:
                # Another engine took memory between our check and now: vLLM's instances
                # race the same way when they start at once (chapter 6.2).
                self.device.release()
                raise
        self._paused = False
        self._sleeping_tags: set[str] = set()
        self.tokenizer = Tokenizer(model_dir)
        self.vocab_size = self.model.spec.vocab_size
        self._token_texts: list[str] | None = None  # each token alone, for constraints
        self.kv_cache = KVCacheManager(self.num_gpu_blocks, args.block_size,
                                       args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill))
        self.groups: dict[str, list[EngineRequest]] = {}  # client request id -> its choices
        self._pending_forks: dict[str, list[EngineRequest]] = {}  # first choice -> the rest
        self._seeds = np.random.SeedSequence(args.seed)
        self._ids = itertools.count()
        # Logits at every scheduled token, kept in last_step_logits (tests compare them with
        # transformers'); normally only the positions sampled from are computed, as in vLLM.
        self.keep_all_logits = False
        self.last_step_logits: dict[str, np.ndarray] = {}
        spec = args.speculative_config
        self.proposer = make_proposer(spec, self.vocab_size, self.max_model_len) if spec else None
        # The records of the latest step, for the metrics (vLLM's SchedulerStats and
        # IterationStats).
        self.last_stats = EngineStats(self.scheduler_stats())

    def _activation_bytes(self, spec: ModelSpec) -> float:
        return activation_bytes(spec, self.args.max_num_batched_tokens, self.args.max_num_seqs,
                                act_dtype_bytes=4)

    def _block_bytes(self, spec: ModelSpec) -> int:
        return self.args.block_size * kv_cache_bytes_per_token(spec, "fp32")

    def _size_kv_cache(self, spec: ModelSpec) -> int:
        """vLLM's rule (chapter 1): what is left of the budget, in whole blocks. The budget
        is ``gpu_memory_utilization`` of the whole device, whoever else uses it."""
        args = self.args
        budget = args.device_memory_gib * GiB * args.gpu_memory_utilization
        num_blocks = num_kv_blocks(
            budget, weights_bytes=self.model.weight_bytes,
            activations_bytes=self._activation_bytes(spec), block_bytes=self._block_bytes(spec))
        check_sequence_fits(self.max_model_len, num_blocks, args.block_size,
                            f"max_model_len={self.max_model_len}",
                            f"{budget / GiB:.2f} GiB holds too little; raise device_memory_gib "
                            f"or gpu_memory_utilization, or lower max_model_len",
                            param="max_model_len")
        logger.info("GPU KV cache size: %d tokens", num_blocks * args.block_size)
        return num_blocks

    # -- requests in --------------------------------------------------------------------

    def process_inputs(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       add_special_tokens: bool = True) -> list[EngineRequest]:
        """Validate and tokenize one prompt: its ``n`` choices, ready for ``add_processed``.

        Safe to call from any thread (it reads only what never changes), so a server runs it
        off the engine loop. ``add_special_tokens`` adds the tokenizer's BOS to a text prompt,
        as vLLM's completions do; a chat prompt already has it from its template.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        token_ids = (encode_prompt(self.tokenizer, text, add_special_tokens) if text is not None
                     else check_token_ids(prompt, self.vocab_size))
        max_tokens = max_tokens_for(len(token_ids), params.max_tokens, self.max_model_len)
        if params.n > self.args.max_num_seqs:
            raise ParameterError("n", f"n must be at most max_num_seqs "
                                      f"({self.args.max_num_seqs}), got {params.n}")
        constraint, allowed = self._constraint(params)
        choices = []
        now = time.monotonic()
        for index in range(params.n):
            choice_params = params.for_choice(index) if params.n > 1 else params
            choice_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = EngineRequest(
                choice_id, token_ids, arrival_time=now, max_tokens=max_tokens,
                params=choice_params, prompt=text, index=index, parent_id=request_id,
                max_model_len=self.max_model_len, eos_token_id=self.tokenizer.eos_token_id,
                rng=rng_for(choice_params.seed, self._seeds.spawn(1)[0]),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, choice_params.stop,
                    include_stop_str_in_output=choice_params.include_stop_str_in_output,
                    skip_special_tokens=choice_params.skip_special_tokens),
                constraint=constraint, allowed=allowed,
                constraint_param="structured_outputs" if params.regex is None else "regex")
            choices.append(request)
        try:
            self.scheduler.check_request(choices[0])
        except ValueError as err:
            raise ParameterError("max_tokens", str(err)) from None
        return choices

    def add_processed(self, choices: list[EngineRequest]) -> str:
        """Queue the choices of one request (from ``process_inputs``); returns its id."""
        first = choices[0]
        if first.parent_id in self.groups:
            raise ParameterError("request_id", f"request_id {first.parent_id!r} is already "
                                               f"in use")
        self.groups[first.parent_id] = choices
        self.scheduler.add_request(first)
        if len(choices) > 1:
            self._pending_forks[first.request_id] = choices[1:]
        return first.parent_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate, tokenize and queue a prompt (text or token ids); returns its id."""
        return self.add_processed(self.process_inputs(prompt, params, request_id))

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (a client that went away)."""
        choices = self.groups.pop(request_id, None)
        if choices is None:
            return
        now = time.monotonic()
        self._pending_forks.pop(choices[0].request_id, None)
        for choice in choices:
            if choice in self.scheduler.running or choice in self.scheduler.waiting:
                self.scheduler.finish_request(choice, now)

    def scheduler_stats(self, prefix_cache_stats: PrefixCacheStats = NO_LOOKUPS
                        ) -> SchedulerStats:
        """The scheduler's state now (vLLM's ``Scheduler.make_stats``), e.g. after an abort."""
        return SchedulerStats.of(self.scheduler, prefix_cache_stats)

    def has_unfinished_requests(self) -> bool:
        """Whether a step would do work; never while asleep: requests that arrive then wait
        in the queue until :meth:`wake_up`, as vLLM's paused scheduler keeps them."""
        return not self.is_sleeping() and self.scheduler.has_unfinished_requests()

    # -- sleep mode (chapter 6.2) -------------------------------------------------------

    def is_sleeping(self) -> bool:
        """Asleep at any level: scheduling paused, or memory handed back."""
        return self._paused or bool(self._sleeping_tags)

    def sleep(self, level: int = 1, mode: str = "abort") -> list[RequestOutput]:
        """Put the engine to sleep, as vLLM 0.32's ``EngineCore.sleep`` with ``mode="abort"``
        (vLLM's other modes, ``"wait"`` and ``"keep"``, are not implemented here).

        Every unfinished request ends now with ``finish_reason="abort"`` (their outputs are
        returned, for whoever streams them) and scheduling pauses; new requests queue until
        :meth:`wake_up`. Level 0 stops there. Level 1 also discards the KV cache (the prefix
        cache forgets everything) and gives the weights' device memory back, keeping the
        weights in host memory (here: the NumPy arrays stay, only the device's ledger changes).
        Level 2 discards the weights too; waking reloads them from the model directory, which
        is what vLLM's ``reload_weights`` does (vLLM's own wake only re-allocates the memory).
        Requires ``enable_sleep_mode`` (vLLM's ``--enable-sleep-mode``).
        """
        if not self.args.enable_sleep_mode:
            raise ParameterError("enable_sleep_mode", "sleep mode is off: start the engine with "
                                                      "enable_sleep_mode=True "
                                                      "(--enable-sleep-mode)")
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ParameterError("level", f"level must be 0, 1 or 2, got {level!r}")
        if mode != "abort":
            raise ParameterError("mode", f"mode must be 'abort' (the only one the teaching "
                                         f"engine has), got {mode!r}")
        start = time.perf_counter()
        outputs = self._abort_all()
        self._paused = True
        if level == 0 or self._sleeping_tags:
            return outputs  # vLLM: "Executor is already sleeping." and nothing more
        self._reset_prefix_cache()
        self.model.allocate_kv_cache(0, self.args.block_size)  # the KV pools' memory goes
        if level == 2:
            self.model = None  # the weights go; wake_up reloads them
        freed = sum(self.device.free(tag) for tag in SLEEP_TAGS) if self.device else 0
        self._sleeping_tags = set(SLEEP_TAGS)
        logger.info("It took %.6f seconds to fall asleep (level %d, %.2f GiB freed).",
                    time.perf_counter() - start, level, freed / GiB)
        return outputs

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Take back the memory of ``tags`` (all when ``None``), as vLLM's ``wake_up``.

        Tags are vLLM's: ``"weights"``, ``"kv_cache"`` and ``"scheduling"`` (level 0). The
        weights come back first, so their memory is taken before the cache's. Scheduling
        resumes only once nothing is asleep; returns whether the engine is fully awake. When
        the device has no room (another engine took the memory meanwhile) this raises
        :class:`~labkit.engine.device.DeviceOutOfMemory` and what could not wake stays asleep.
        """
        if tags is not None:
            tags = list(tags)
            for tag in tags:
                if tag not in (*SLEEP_TAGS, "scheduling"):
                    raise ParameterError("tags", f"tags must be among weights, kv_cache and "
                                                 f"scheduling, got {tag!r}")
        start = time.perf_counter()
        wanted = [t for t in SLEEP_TAGS if t in self._sleeping_tags
                  and (tags is None or t in tags)]
        for tag in wanted:
            loaded = None
            if tag == "weights" and self.model is None:  # level 2: read them from disk again
                loaded = LlamaModel.load(self.args.model, num_blocks=0,
                                         block_size=self.args.block_size)
            if self.device is not None:
                self.device.allocate(tag, self._device_bytes[tag])
            if loaded is not None:
                self.model = loaded
            self._sleeping_tags.discard(tag)
        if self.model is not None and "kv_cache" not in self._sleeping_tags:
            if not self.model.kv or self.model.kv[0].k.shape[0] != self.num_gpu_blocks:
                self.model.allocate_kv_cache(self.num_gpu_blocks, self.args.block_size)
        if wanted:
            logger.info("It took %.6f seconds to wake up tags %s.",
                        time.perf_counter() - start, wanted)
        if not self._sleeping_tags:
            self._paused = False
        return not self.is_sleeping()

    def close(self) -> None:
        """Give the simulated device's memory back (the process is done with the engine)."""
        if self.device is not None:
            self.device.release()

    def _abort_all(self) -> list[RequestOutput]:
        """End every unfinished request with ``finish_reason="abort"``; their outputs."""
        now = time.monotonic()
        outputs = []
        for parent_id, choices in list(self.groups.items()):
            self._pending_forks.pop(choices[0].request_id, None)
            for choice in choices:
                if choice.is_finished:
                    continue
                if choice in self.scheduler.running or choice in self.scheduler.waiting:
                    self.scheduler.finish_request(choice, now)
                else:  # a forked choice that has not started: it was never scheduled
                    choice.finish_reason = "abort"
                    choice.finish(now)
                choice.detokenizer.finish()
            outputs.append(self._output(parent_id))
        return outputs

    def _reset_prefix_cache(self) -> None:
        """Forget every cached block, as vLLM's ``reset_prefix_cache`` (no request holds one:
        they were all aborted). The manager keeps its running totals of lookups and hits."""
        kv = self.kv_cache
        kv.block_pool = BlockPool(kv.num_blocks, enable_caching=kv.enable_prefix_caching)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that got a token.

        An exception from here means the engine itself is broken (a request's own problems
        end that request in ``check_stop``); the async engine then declares itself dead.
        """
        if self.is_sleeping():
            return []
        kv = self.kv_cache
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        out = self.scheduler.schedule()
        lookups = PrefixCacheStats(kv.prefix_cache_queries - queries, kv.prefix_cache_hits - hits)
        stats = IterationStats(num_preempted_reqs=len(out.preempted))
        if not out.requests:
            self.last_stats = EngineStats(self.scheduler_stats(lookups), stats)
            return []
        now = time.monotonic()
        batch = []
        for request in out.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = request.num_computed_tokens
            start = request.num_computed_tokens
            drafts = out.spec_token_ids.get(request.request_id, [])
            num_known = out.num_scheduled_tokens[request.request_id] - len(drafts)
            new = request.token_ids[start:start + num_known] + drafts
            batch.append(SequenceBatch(new, start, out.block_ids[request.request_id],
                                       all_logits=self.keep_all_logits or bool(drafts)
                                       or request.params.prompt_logprobs is not None))
        logits = self.model.forward(batch)
        if self.keep_all_logits:
            self.last_step_logits = {r.request_id: rows for r, rows
                                     in zip(out.requests, logits, strict=True)}
        sampled: dict[str, int | list[int]] = {}
        spec_stats = (SpecDecodingStats(self.proposer.config.num_speculative_tokens)
                      if self.proposer is not None else None)
        forks: list[tuple[EngineRequest, EngineRequest, int]] = []
        for request, rows, seq in zip(out.requests, logits, batch, strict=True):
            start = request.num_computed_tokens
            if request.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(request, rows, start)
            if start + len(seq.token_ids) < request.num_tokens:
                continue  # a prefill chunk: nothing to sample yet
            if request.num_output_tokens == 0 and request.num_preemptions == 0:
                stats.num_prompt_tokens += request.prompt_len  # cached ones too, as vLLM
            drafts = out.spec_token_ids.get(request.request_id)
            if drafts:
                emitted = verify(drafts, rows[-len(drafts) - 1:], request.params, request.rng,
                                 request.sampling_mask(self.vocab_size))
                spec_stats.observe_draft(len(drafts), len(emitted) - 1)
                sampled[request.request_id] = emitted
                continue
            sampled[request.request_id] = self._sample(request, rows[-1])
            # The other choices sample their first token from the same logits.
            forks += [(request, child, self._sample(child, rows[-1]))
                      for child in self._pending_forks.pop(request.request_id, [])]
        now = time.monotonic()
        emitted_before = {r.request_id: r.num_output_tokens for r in out.requests}
        self.scheduler.update(out, now, sampled)
        for parent, child, token in forks:
            child.first_scheduled_time = parent.first_scheduled_time
            child.num_cached_tokens = parent.num_cached_tokens
            if not child.append_output_token(token, now):
                self.model.copy_blocks(self.scheduler.fork_request(parent, child))
        for request in (r for r in out.requests if r.request_id in sampled):
            stats.record_token(request,
                               request.num_output_tokens - emitted_before[request.request_id])
        for _, child, _ in forks:
            stats.record_token(child)
        if self.proposer is not None:  # drafts for the next step to verify
            propose_drafts(self.proposer, self.scheduler.running)
        self.last_stats = EngineStats(self.scheduler_stats(lookups), stats, spec_stats)
        return [self._output(parent) for parent in dict.fromkeys(
            r.parent_id for r in out.requests if r.request_id in sampled
            and (r.params.output_kind is RequestOutputKind.CUMULATIVE
                 or all(c.is_finished for c in self.groups[r.parent_id])))]

    def _sample(self, request: EngineRequest, row: np.ndarray) -> int:
        token = sample(row, request.params, request.rng, request.sampling_mask(len(row)))
        if request.params.logprobs is not None:
            request.logprobs.append(logprobs_of(row, token, request.params.logprobs,
                                                self._token_text))
        return token

    def _record_prompt_logprobs(self, request: EngineRequest, rows: np.ndarray,
                                start: int) -> None:
        """Row ``j`` predicts the token after position ``start + j``: a prompt token's
        logprob comes from the row before it (the first prompt token has none)."""
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)
        num = request.params.prompt_logprobs
        while len(request.prompt_logprobs) < request.prompt_len:
            position = len(request.prompt_logprobs)  # the token whose logprob is next
            row = position - 1 - start
            if not 0 <= row < len(rows):
                break  # recomputed after a preemption, or in a later chunk
            request.prompt_logprobs.append(logprobs_of(
                rows[row], request.token_ids[position], num, self._token_text))

    def _output(self, parent_id: str) -> RequestOutput:
        choices = self.groups[parent_id]
        first = choices[0]
        finished = all(c.is_finished for c in choices)
        if finished:
            del self.groups[parent_id]
        error = next((c.error for c in choices if c.error is not None), None)
        prompt_logprobs = (list(first.prompt_logprobs)
                           if first.params.prompt_logprobs is not None else None)
        return RequestOutput(parent_id, first.prompt, list(first.prompt_token_ids),
                             [c.completion() for c in choices], finished,
                             first.request_metrics(), first.num_cached_tokens,
                             prompt_logprobs, error)

    # -- inputs -------------------------------------------------------------------------

    def _constraint(self, params: SamplingParams
                    ) -> tuple[RegexConstraint | None, np.ndarray | None]:
        """The output constraint and its mask for the first token; refuse a dead end now."""
        if params.regex is not None:
            param, pattern = "regex", params.regex
        elif params.structured_outputs is not None:
            param, pattern = "structured_outputs", params.structured_outputs.to_regex()
        else:
            return None, None
        if self._token_texts is None:
            # Special tokens write no text: only EOS may end a match, and the constraint
            # knows it by id.
            self._token_texts = [self.tokenizer.decode([t], skip_special_tokens=True)
                                 for t in range(self.tokenizer.vocab_size)]
        try:
            constraint = RegexConstraint(pattern, self._token_texts, self.tokenizer.eos_token_id)
            allowed = constraint.allowed("")
        except ValueError as err:
            raise ParameterError(param, str(err)) from None
        if not allowed.any():
            raise ParameterError(param, f"{param}: no token of this model's vocabulary can "
                                        f"start a match")
        return constraint, allowed

    def _token_text(self, token_id: int) -> str:
        """A token's text in logprobs, as vLLM writes it: the token decoded alone, special
        tokens included (``<|begin_of_text|>`` of an echoed prompt; vLLM 0.32's
        ``convert_ids_list_to_tokens`` in ``vllm/tokenizers/detokenizer_utils.py``)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
