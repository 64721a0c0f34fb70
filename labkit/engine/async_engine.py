"""Run the engine loop in a background thread and stream its outputs to asyncio (ch. 2.2).

The HTTP server is asynchronous; the engine is a plain loop of ``step()`` calls. One thread
owns the engine: it takes new requests and aborts from a queue, steps while there is work,
and hands each output to the waiting coroutine with ``call_soon_threadsafe``. A coroutine
that is cancelled (its client disconnected) aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from labkit.engine.llm_engine import EngineArgs, LLMEngine
from labkit.engine.metrics import EngineMetrics
from labkit.engine.outputs import RequestOutput
from labkit.engine.sampling import SamplingParams


class AsyncLLMEngine:
    """An :class:`LLMEngine` driven by its own thread, for use from asyncio code."""

    def __init__(self, args: EngineArgs, served_model_name: str | None = None) -> None:
        self.engine = LLMEngine(args)
        self.model_name = served_model_name or args.model
        self.metrics = EngineMetrics(self.model_name)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every new token, until it finishes.

        Bad prompts raise ``ValueError`` before anything is queued.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        done = threading.Event()
        error: list[Exception] = []
        self._commands.put(("add", (prompt, params, request_id, done, error)))
        await loop.run_in_executor(None, done.wait)
        if error:
            del self._streams[request_id]
            raise error[0]
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished_requests()
            try:
                while True:
                    self._handle(*self._commands.get(block=block, timeout=None if block else 0))
                    block = False
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            self.metrics.record_step(engine, outputs)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    loop, q = stream
                    loop.call_soon_threadsafe(q.put_nowait, output)

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            prompt, params, request_id, done, error = payload
            try:
                self.engine.add_request(prompt, params, request_id)
            except ValueError as err:
                error.append(err)
            done.set()
        elif kind == "abort":
            self.engine.abort_request(payload)
            self.metrics.forget(payload)
            self.metrics.record_step(self.engine, [])
