"""The OpenAI API's request bodies and response pieces, as ``vllm serve`` reads and writes
them (:doc:`chapter 2 </chapters/ch02_engines>`, :ref:`ch02-streaming`).

Every field vLLM honours either maps onto :class:`~labkit.engine.SamplingParams` here or,
if the teaching engine does not implement it, is refused with a 400 that names it; nothing
is accepted and silently ignored. Unknown fields are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from labkit.checks import ParameterError
from labkit.engine.outputs import CompletionOutput, Logprob, RequestOutput
from labkit.engine.sampling import SamplingParams
from labkit.engine.structured import StructuredOutputsParams, from_response_format

# Fields vLLM or OpenAI define that the teaching engine does not implement, with the value
# that means "off": any other value is refused rather than ignored.
# ``echo`` and the chat template's fields count for chat only: completions declare ``echo``.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "min_p": 0, "logit_bias": None, "best_of": 1, "suffix": None, "tools": None,
               "tool_choice": "none", "functions": None, "prompt_embeds": None,
               "guided_json": None, "guided_regex": None, "guided_choice": None,
               "guided_grammar": None, "use_beam_search": False, "length_penalty": 1,
               "truncate_prompt_tokens": None, "audio": None, "modalities": None,
               "allowed_token_ids": None, "bad_words": [], "logits_processors": None,
               "priority": 0, "return_tokens_as_token_ids": False, "return_token_ids": False,
               "echo": False, "continue_final_message": False, "chat_template": None,
               "chat_template_kwargs": None, "documents": None}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class _SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # optional in vLLM: the one model served
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    regex: str | None = None  # SGLang's name, kept for chapter 2.3's examples
    structured_outputs: dict | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        for name, off in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, off)
            if value in (off, None):
                continue
            if name.startswith("guided_"):  # vLLM 0.33 removed them (and ignores them)
                raise ParameterError(name, f"{name} was removed from vLLM; use "
                                           f"structured_outputs instead")
            raise ParameterError(name, f"{name} is not supported by the teaching engine "
                                       f"(got {value!r})")
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when "
                                                   "stream is true")
        if self.stream and self.prompt_logprobs:  # vLLM's rule: a stream has no place for them
            raise ParameterError("prompt_logprobs", "prompt_logprobs are not available when "
                                                    "stream is true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        self.check_supported()
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, regex=self.regex,
            structured_outputs=self._structured_outputs())

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's ``structured_outputs`` object, then OpenAI's ``response_format`` on top."""
        params = None
        if self.structured_outputs is not None:
            params = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.response_format is not None:
            params = from_response_format(self.response_format, params)
        return params


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ParameterError("prompt", "prompt: a list of prompts is not supported "
                                               "by the teaching engine; send one request per "
                                               "prompt")
            prompt = prompt[0]
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        # vLLM returns the prompt's logprobs beside the echoed prompt.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. Without ``max_completion_tokens`` (or the older
    ``max_tokens``) a reply may use the rest of the context window, as in vLLM. The rendered
    prompt is encoded without special tokens (its template wrote them) unless
    ``add_special_tokens`` asks for them, as in vLLM."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs needs logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs)

    def field_error(self, err: ParameterError) -> ParameterError:
        """``err``, about an engine parameter, renamed after the chat field that set it
        (``top_logprobs``, ``max_completion_tokens``, ``messages``): ``param`` names what
        the client sent."""
        fields = {"logprobs": "top_logprobs", "prompt": "messages",
                  "max_tokens": ("max_tokens" if self.max_completion_tokens is None
                                 else "max_completion_tokens")}
        name = fields.get(err.param, err.param)
        if name == err.param:
            return err
        message = str(err)
        return ParameterError(name, name + message.removeprefix(err.param)
                              if message.startswith(err.param) else message)

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- responses ----------------------------------------------------------------------------

def usage(output: RequestOutput, completion: int | None = None) -> dict:
    """Token counts: the prompt's and, unless ``completion`` is given (a stream's running
    count, as vLLM's ``continuous_usage_stats`` reports one choice's), every choice's."""
    prompt = len(output.prompt_token_ids)
    if completion is None:
        completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int],
                        text_offset: int, decode) -> dict:
    """OpenAI's legacy ``logprobs`` object: tokens, their logprobs, the top alternatives and
    each token's offset in the text (a prompt's first token has no logprob)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = decode(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(entry[token_id].logprob)
        top.append({p.decoded_token: p.logprob for p in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int],
                  num_top: int) -> dict:
    """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and the
    ``top_logprobs`` most likely alternatives in rank order."""

    def item(p: Logprob) -> dict:
        return {"token": p.decoded_token, "logprob": p.logprob,
                "bytes": list(p.decoded_token.encode("utf-8", errors="replace"))}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        ranked = sorted((p for p in entry.values() if p.rank <= num_top), key=lambda p: p.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(p) for p in ranked]})
    return {"content": content}


def prompt_logprobs_json(output: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, ``{token_id: Logprob}``."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.decoded_token}
             for t, p in entry.items()} for entry in output.prompt_logprobs]


def finish_fields(choice: CompletionOutput) -> dict:
    return {"finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
