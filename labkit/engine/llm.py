"""vLLM's offline API over the teaching engine: ``LLM(model=...).generate(...)``
(:ref:`ch02-offline-api`).

:class:`LLM` queues every prompt on an :class:`~labkit.engine.LLMEngine` and steps it until all
are done, as vLLM's ``LLM`` (``vllm/entrypoints/llm.py``) drives its engine;
:func:`pair_prompts` reads ``generate``'s arguments the way vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from labkit.checks import ParameterError
from labkit.engine.llm_engine import EngineArgs, LLMEngine
from labkit.engine.outputs import RequestOutput
from labkit.engine.request import EngineRequest
from labkit.engine.sampling import RequestOutputKind, SamplingParams
from labkit.engine.tokenizer import Tokenizer


class LLM:
    """vLLM's offline API over the teaching engine: ``LLM(model=...).generate(...)``."""

    def __init__(self, model: str, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``LLM.sleep``: hand the device memory back (needs ``enable_sleep_mode``);
        see :meth:`~labkit.engine.LLMEngine.sleep` for the levels."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """vLLM's ``LLM.wake_up``: take the memory back; True once fully awake."""
        return self.llm_engine.wake_up(tags)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        prompts, params = pair_prompts(prompts, sampling_params)
        return self._run([self.llm_engine.process_inputs(p, sp)
                          for p, sp in zip(prompts, params, strict=True)], use_tqdm)

    def chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate a reply to one conversation, rendered with the model's chat template."""
        tokenizer = self.llm_engine.tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return self._run([self.llm_engine.process_inputs(ids, sampling_params)], use_tqdm)

    def _run(self, requests: list[list[EngineRequest]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        if engine.is_sleeping():
            # vLLM would queue them and wait for a wake_up that nobody can send from here.
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        for choice in (c for choices in requests for c in choices):
            choice.params = replace(choice.params, output_kind=RequestOutputKind.FINAL_ONLY)
        ids = [engine.add_processed(choices) for choices in requests]
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids), use_tqdm)
        while len(finished) < len(ids):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    progress.update(1)
        progress.close()
        return [finished[i] for i in ids]


def pair_prompts(prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 ) -> tuple[list, list[SamplingParams]]:
    """vLLM's offline ``generate`` arguments as two lists of equal length: one prompt (text
    or token ids) or many, and one ``SamplingParams`` for all of them or one each."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    params = sampling_params or SamplingParams()
    params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ParameterError("sampling_params", "sampling_params: give one per prompt, "
                                                "or a single one")
    return list(prompts), params


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="Processed prompts")
