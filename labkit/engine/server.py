"""An OpenAI-compatible HTTP server for the teaching engine (chapter 2.2).

The same routes as ``vllm serve``: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streaming over server-sent events or not), ``/health`` and
``/metrics``. Errors come back as OpenAI-style JSON (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx status, so the official ``openai`` client raises its usual exceptions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from labkit.engine.async_engine import AsyncLLMEngine
from labkit.engine.outputs import RequestOutput
from labkit.engine.sampling import SamplingParams


class _Sampling(BaseModel):
    """Fields shared by both endpoints; unknown fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    regex: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported by the teaching engine")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                              ignore_eos=self.ignore_eos, regex=self.regex)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


_PARAMS = {"prompt", "messages", "model", "temperature", "top_p", "top_k", "max_tokens", "n",
           "seed", "stop", "stop_token_ids", "regex"}


def _param_of(message: str) -> str | None:
    """The request field an engine error message starts with, if any."""
    word = message.split(maxsplit=1)[0].rstrip(":") if message else ""
    return word if word in _PARAMS else None


def error_response(status: int, message: str, type_: str, param: str | None = None):
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": type_, "param": param, "code": status}})


def build_app(engine: AsyncLLMEngine) -> FastAPI:
    """The FastAPI application serving ``engine``."""
    app = FastAPI(title="labkit teaching engine", docs_url=None, redoc_url=None)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{param or 'body'}: {first['msg']}", "BadRequestError",
                              param)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "labkit", "max_model_len": max_model_len}]}

    def check_model(body: _Sampling) -> None:
        if body.model != engine.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "NotFoundError",
                           "model")

    async def start(prompt, body: _Sampling, prefix: str):
        check_model(body)
        try:
            params = body.sampling_params(default_max_tokens=16)
            stream = engine.generate(prompt, params, f"{prefix}-{uuid.uuid4().hex}")
            first = await stream.__anext__()  # raises ValueError for a bad prompt
        except ValueError as err:
            raise APIError(400, str(err), "BadRequestError", _param_of(str(err))) from None
        return stream, first

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        stream, first = await start(body.prompt, body, "cmpl")
        created = int(time.time())

        def chunk(output: RequestOutput, text: str, is_first: bool = False) -> dict:
            c = output.outputs[0]
            return {"id": output.request_id, "object": "text_completion", "created": created,
                    "model": engine.model_name, "choices": [{
                        "index": 0, "text": text, "logprobs": None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

        if body.stream:
            return _sse(stream, first, chunk, body)
        final = await _collect(stream, first, http)
        response = chunk(final, final.outputs[0].text)
        response["usage"] = _usage(final)
        return response

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        messages = [m.model_dump() for m in body.messages]
        try:
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
        except ValueError as err:
            raise APIError(400, str(err), "BadRequestError", "messages") from None
        stream, first = await start(prompt, body, "chatcmpl")
        created = int(time.time())

        def chunk(output: RequestOutput, text: str, is_first: bool = False) -> dict:
            c = output.outputs[0]
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            return {"id": output.request_id, "object": "chat.completion.chunk",
                    "created": created, "model": engine.model_name, "choices": [{
                        "index": 0, "delta": delta,
                        "logprobs": None, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason}]}

        if body.stream:
            return _sse(stream, first, chunk, body)
        final = await _collect(stream, first, http)
        c = final.outputs[0]
        return {"id": final.request_id, "object": "chat.completion", "created": created,
                "model": engine.model_name, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}],
                "usage": _usage(final)}

    return app


def _usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _collect(stream: AsyncIterator[RequestOutput], first: RequestOutput,
                   http: Request) -> RequestOutput:
    """Run a non-streaming request to the end; abort it if the client goes away."""

    async def drain() -> RequestOutput:
        last = first
        async for output in stream:
            last = output
        return last

    if first.finished:
        return first
    task = asyncio.create_task(drain())
    while not task.done():
        if await http.is_disconnected():
            task.cancel()
            await stream.aclose()  # aborts the request, freeing its KV blocks
            raise asyncio.CancelledError
        await asyncio.wait({task}, timeout=0.05)
    return task.result()


def _sse(stream, first: RequestOutput, chunk, body: _Sampling) -> StreamingResponse:
    """Server-sent events: one ``data:`` line per new piece of text, then ``[DONE]``."""
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    async def events():
        sent, output = "", first
        try:
            while True:
                text = output.outputs[0].text
                piece = chunk(output, text[len(sent):], is_first=output is first)
                yield f"data: {json.dumps(piece)}\n\n"
                sent = text
                if output.finished:
                    break
                output = await stream.__anext__()
            if include_usage:
                usage = chunk(output, "")
                usage["choices"], usage["usage"] = [], _usage(output)
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # a client that disconnected mid-stream frees its blocks

    return StreamingResponse(events(), media_type="text/event-stream")
