"""An OpenAI-compatible HTTP server for the teaching engine (:ref:`ch02-streaming`).

The same routes as ``vllm serve``: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streaming over server-sent events or not), ``/tokenize``,
``/health`` and ``/metrics``; with ``VLLM_SERVER_DEV_MODE=1``, as in vLLM, also the sleep-mode
routes ``POST /sleep?level=``, ``POST /wake_up`` and ``GET /is_sleeping``
(:doc:`/chapters/ch06_gpu_sharing`).
Every 4xx is an OpenAI error object (``{"error": {"message", "type", "param", "code"}}``), so
the official ``openai`` client raises its usual exceptions; the handlers are the ones the
gateway uses too (:func:`labkit.http.openai.add_error_handlers`), plus a 503 for a dead engine
and for a device without room to wake.
As with vLLM, ``--api-key`` (or ``VLLM_API_KEY``) protects the ``/v1`` routes, and
``/health`` answers 503 once the engine loop has died, so an orchestrator restarts the server.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from labkit.checks import ParameterError
from labkit.engine import protocol
from labkit.engine.async_engine import AsyncLLMEngine, EngineDeadError
from labkit.engine.device import DeviceOutOfMemory
from labkit.engine.outputs import RequestOutput
from labkit.engine.protocol import ChatCompletionRequest, CompletionRequest
from labkit.http.openai import (
    APIError,
    APIKeyAuthentication,
    add_error_handlers,
    error_body,
    error_response,
)
from labkit.http.sse import DONE_BYTES, event_bytes

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a body past this is refused before it is parsed
#: vLLM registers its development routes (sleep mode among them) only when this is "1".
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize`` body in either of its forms: a ``prompt``, encoded as
    ``/v1/completions`` encodes it, or chat ``messages``, rendered as
    ``/v1/chat/completions`` renders them. ``add_special_tokens`` defaults as vLLM's two
    request types do (``vllm/entrypoints/serve/tokenize/protocol.py``, vLLM 0.32): on for a
    prompt, off for messages, whose template writes the BOS itself."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[protocol.ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParameterError("prompt", "give either prompt or messages, not both or "
                                           "neither")
        # vLLM's chat fields that the teaching engine's template renderer does not take.
        for name in ("continue_final_message", "chat_template", "chat_template_kwargs",
                     "tools"):
            off = protocol.UNSUPPORTED[name]
            value = (self.model_extra or {}).get(name, off)
            if value not in (off, None):
                raise ParameterError(name, f"{name} is not supported by the teaching engine "
                                           f"(got {value!r})")


def build_app(engine: AsyncLLMEngine, *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              dev_mode: bool | None = None) -> FastAPI:
    """The FastAPI application serving ``engine``. ``dev_mode`` (default: the environment's
    ``VLLM_SERVER_DEV_MODE=1``) adds vLLM's sleep-mode routes."""
    app = FastAPI(title="labkit teaching engine", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyAuthentication, api_key=api_key)
    tokenizer = engine.engine.tokenizer
    decode_one = engine.engine._token_text  # noqa: SLF001 - the engine's one token-text rule

    add_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(503, str(exc))

    @app.exception_handler(DeviceOutOfMemory)
    async def _no_room(_: Request, exc: DeviceOutOfMemory):
        # Waking needs memory another engine may hold now: retry once it is free.
        return error_response(503, str(exc))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.errored else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "labkit", "max_model_len": engine.engine.max_model_len}]}

    def check_model(model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def start(prompt, params, prefix: str, add_special_tokens: bool):
        """Queue the request; a request that fails at its first step is a 400 here."""
        stream = engine.generate(prompt, params, f"{prefix}-{uuid.uuid4().hex}",
                                 add_special_tokens=add_special_tokens)
        first = await stream.__anext__()
        if first.error is not None:
            await stream.aclose()
            raise first.error
        return stream, first

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        stream, first = await start(prompt, params, "cmpl", body.add_special_tokens)
        created = int(time.time())
        echo = _prompt_text(first, tokenizer) if body.echo else ""
        # Each choice's next ``text_offset``. Offsets add up the tokens' own texts, as vLLM's
        # do, not the text sent so far (held-back or multi-byte text differs), so the chunks
        # of a stream carry exactly the offsets of the non-streamed response.
        text_offsets = [0] * params.n

        def choice(output: RequestOutput, index: int, text: str, tokens: slice) -> dict:
            c = output.outputs[index]
            logprobs = None
            if c.logprobs is not None:
                ids, entries = c.token_ids[tokens], c.logprobs[tokens]
                if body.echo and tokens.start == 0:  # the prompt's tokens come first
                    ids = output.prompt_token_ids + ids
                    entries = (output.prompt_logprobs or []) + entries
                logprobs = protocol.completion_logprobs(entries, ids, text_offsets[index],
                                                        decode_one)
                text_offsets[index] += sum(map(len, logprobs["tokens"]))
            if body.echo and tokens.start == 0:
                text = echo + text
            return {"index": index, "text": text, "logprobs": logprobs,
                    **protocol.finish_fields(c)}

        def chunk(output: RequestOutput, choices: list[dict]) -> dict:
            return {"id": output.request_id, "object": "text_completion", "created": created,
                    "model": engine.model_name, "choices": choices}

        if body.stream:
            return _sse(stream, first, lambda o, i, t, s: chunk(o, [choice(o, i, t, s)]),
                        chunk, body)
        final = await _collect(stream, first, http)
        if final is None:
            return Response(status_code=499)  # the client left; nobody reads this
        response = chunk(final, [choice(final, i, c.text, slice(0, None))
                                 for i, c in enumerate(final.outputs)])
        if final.prompt_logprobs is not None:
            for c in response["choices"]:
                c["prompt_logprobs"] = protocol.prompt_logprobs_json(final)
        response["usage"] = protocol.usage(final)
        return response

    async def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation through the model's chat template, off the event loop."""
        try:
            return await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                           add_generation_prompt)
        except ParameterError:
            raise  # the tokenizer's own, already naming messages
        except (ValueError, jinja2.TemplateError) as err:
            raise ParameterError("messages", f"messages: {err}") from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        check_model(body.model)
        try:
            params = body.to_sampling_params()
            prompt = await render(body.message_dicts(), body.add_generation_prompt)
            stream, first = await start(prompt, params, "chatcmpl", body.add_special_tokens)
        except ParameterError as err:
            raise body.field_error(err) from None
        created = int(time.time())
        num_top = params.logprobs or 0

        def logprobs(c, tokens: slice):
            if c.logprobs is None:
                return None
            return protocol.chat_logprobs(c.logprobs[tokens], c.token_ids[tokens], num_top)

        def chunk(output: RequestOutput, choices: list[dict]) -> dict:
            return {"id": output.request_id, "object": "chat.completion.chunk",
                    "created": created, "model": engine.model_name, "choices": choices}

        def delta(output: RequestOutput, index: int, text: str, tokens: slice) -> dict:
            c = output.outputs[index]
            # vLLM sends stop_reason only with the chunk that finishes the choice.
            finish = protocol.finish_fields(c) if c.finished else {"finish_reason": None}
            return chunk(output, [{"index": index, "delta": {"content": text},
                                   "logprobs": logprobs(c, tokens), **finish}])

        if body.stream:
            return _sse(stream, first, delta, chunk, body, role="assistant")
        final = await _collect(stream, first, http)
        if final is None:
            return Response(status_code=499)
        return {"id": final.request_id, "object": "chat.completion", "created": created,
                "model": engine.model_name, "choices": [{
                    "index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs(c, slice(0, None)), **protocol.finish_fields(c)}
                    for i, c in enumerate(final.outputs)],
                "usage": protocol.usage(final),
                "prompt_logprobs": protocol.prompt_logprobs_json(final)}  # vLLM's, top level

    if dev_mode is None:
        dev_mode = os.environ.get(DEV_MODE_ENV) == "1"
    if dev_mode:  # an engine without --enable-sleep-mode answers them with a 400
        add_sleep_routes(app, engine)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """The prompt's token ids, as the engine would see them. vllm-router's
        ``cache_aware`` policy asks a worker for them (chapter 5) and keys its prefix tree
        on tokens rather than characters when it gets them."""
        check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            text = await render([{"role": m.role, "content": m.text()} for m in body.messages],
                                body.add_generation_prompt)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = tokenizer.encode(text, add_special_tokens=special)
        strs = ([tokenizer.hf_tokenizer.id_to_token(i) for i in ids] if body.return_token_strs
                else None)
        return {"count": len(ids), "max_model_len": engine.engine.max_model_len,
                "tokens": ids, "token_strs": strs}

    return app


def add_sleep_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """vLLM 0.32's development routes for sleep mode, same paths, parameters and answers
    (``vllm/entrypoints/serve/dev/sleep/api_router.py``)."""

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2), mode: str = "abort") -> dict:
        await engine.sleep(level, mode)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        tags = request.query_params.getlist("tags") or None  # none given: wake everything
        fully_awake = await engine.wake_up(tags)
        return {"status": "awake" if fully_awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": engine.is_sleeping()}


def _prompt_text(output: RequestOutput, tokenizer) -> str:
    if output.prompt is not None:
        return output.prompt
    return tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


async def _collect(stream: AsyncIterator[RequestOutput], first: RequestOutput,
                   http: Request) -> RequestOutput | None:
    """Run a non-streaming request to the end; ``None`` (and the request aborted, its blocks
    freed) if the client went away first. A request that failed raises its error."""

    async def drain() -> RequestOutput:
        last = first
        async for output in stream:
            last = output
            if output.error is not None:
                break  # the request has failed: its other choices need not run on
        return last

    final = first
    if not first.finished:
        task = asyncio.create_task(drain())
        while not task.done():
            if await http.is_disconnected():
                # The generator is still running inside ``task``: closing it now would raise.
                # Cancelling the task ends it, and its ``finally`` aborts the request.
                task.cancel()
                await asyncio.wait({task})
                return None
            await asyncio.wait({task}, timeout=0.05)
        final = task.result()
    if final.error is not None:
        await stream.aclose()  # aborts what is still running of it
        raise final.error
    return final


def _sse(stream: AsyncIterator[RequestOutput], first: RequestOutput,
         delta: Callable[[RequestOutput, int, str, slice], dict],
         chunk: Callable[[RequestOutput, list[dict]], dict], body,
         role: str | None = None) -> StreamingResponse:
    """Server-sent events: a chunk per choice whenever it gets a token, then ``[DONE]``.

    Each chunk carries the part of the choice's text not sent before; the engine's outputs
    only ever extend the text, so the chunks add up to the final text. An error after the
    stream has started goes out as an error event, as vLLM sends it.
    """
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    # vLLM's continuous_usage_stats: every chunk also carries its choice's usage so far.
    running_usage = include_usage and options.continuous_usage_stats

    def with_usage(payload: dict, output: RequestOutput, completion: int) -> dict:
        if not running_usage:
            return payload
        return {**payload, "usage": protocol.usage(output, completion)}

    async def events():
        n = len(first.outputs)
        sent_text, sent_tokens, done = [0] * n, [0] * n, [False] * n
        output = first
        try:
            if role is not None:  # chat: announce the speaker first, as OpenAI does
                yield event_bytes(with_usage(chunk(first, [
                    {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(n)]), first, 0))
            while True:
                if output.error is not None:
                    raise output.error
                for i, c in enumerate(output.outputs):
                    if done[i] or (len(c.token_ids) == sent_tokens[i] and not c.finished):
                        continue
                    piece = c.text[sent_text[i]:]
                    new_tokens = slice(sent_tokens[i], None)
                    yield event_bytes(with_usage(delta(output, i, piece, new_tokens), output,
                                                 len(c.token_ids)))
                    sent_text[i], sent_tokens[i], done[i] = len(c.text), len(c.token_ids), \
                        c.finished
                if output.finished:
                    break
                output = await stream.__anext__()
            if include_usage:
                yield event_bytes({**chunk(output, []), "usage": protocol.usage(output)})
        except (ParameterError, EngineDeadError) as err:
            status = 400 if isinstance(err, ParameterError) else 503
            yield event_bytes(error_body(status, str(err), getattr(err, "param", None)))
        finally:
            await stream.aclose()  # a client that disconnected mid-stream frees its blocks
        yield DONE_BYTES

    return StreamingResponse(events(), media_type="text/event-stream")


class _BodyLimit:
    """Refuse request bodies over ``max_bytes`` with a 413, counting what actually arrives
    (a client can send a body without ``Content-Length``). The body is read here, at most
    ``max_bytes`` of it, and handed on to the application in one piece."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"the request body is larger than this server's "
                                        f"limit of {self.max_bytes} bytes")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return
            body += event.get("body", b"")
            if len(body) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not event.get("more_body", False):
                break
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as Starlette expects

        await self.app(scope, replay, send)
