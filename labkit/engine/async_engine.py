"""Run the engine loop in a background thread and stream its outputs to asyncio
(:ref:`ch02-streaming`).

The HTTP server is asynchronous; the engine is a plain loop of ``step()`` calls. One thread
owns the engine: it takes new requests and aborts from a queue, steps while there is work,
and hands each output to the waiting coroutine with ``call_soon_threadsafe``. Everything that
can be done without the engine's state (validation, tokenization of a 5 MB prompt) happens
before a request reaches that thread, so it never stalls the streams already running.

A coroutine that is cancelled (its client disconnected) aborts its request, which frees its
KV blocks. If ``step()`` itself raises, the engine is broken, not the request: like vLLM's
``EngineDeadError``, every open stream ends with the error, ``errored`` turns true (the
server's ``/health`` answers 503) and new requests are refused at once.

Sleep and wake (:doc:`/chapters/ch06_gpu_sharing`) run on the same thread, between two steps, like
any request: the requests a sleep aborts end their streams with ``finish_reason="abort"``, and
requests that arrive while asleep wait in the queue until the engine wakes (vLLM 0.32's paused
scheduler keeps them the same way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from labkit.engine.llm_engine import EngineArgs, LLMEngine
from labkit.engine.metrics import EngineMetrics
from labkit.engine.outputs import RequestOutput
from labkit.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an internal error; the server must be restarted."""


class AsyncLLMEngine:
    """An :class:`~labkit.engine.LLMEngine` driven by its own thread, for use from asyncio code."""

    def __init__(self, args: EngineArgs, served_model_name: str | None = None) -> None:
        self.engine = LLMEngine(args)
        self.model_name = served_model_name or args.model
        spec = args.speculative_config
        self.metrics = EngineMetrics(self.model_name,
                                     spec.num_speculative_tokens if spec is not None else None)
        self.dead_error: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or not self._thread.is_alive()

    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` unless the engine loop is alive."""
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       request_id: str | None = None, *,
                       add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every new token, until it finishes.

        Bad input raises :class:`~labkit.checks.ParameterError` before anything is queued;
        a dead engine raises :class:`EngineDeadError`.
        """
        self.check_health()
        request_id = request_id or f"req-{next(self._ids)}"
        choices = await asyncio.to_thread(self.engine.process_inputs, prompt, params,
                                          request_id, add_special_tokens=add_special_tokens)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        finished = False
        try:
            self.check_health()  # a loop that died before we registered never answers us
            self._commands.put(("add", choices))
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """:meth:`~labkit.engine.LLMEngine.sleep` on the engine's thread (vLLM's
        ``AsyncLLM.sleep``)."""
        await self._on_engine_thread("sleep", level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """:meth:`~labkit.engine.LLMEngine.wake_up` on the engine's thread; True once fully
        awake."""
        return await self._on_engine_thread("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop the loop after its current step and give the simulated device back. A step
        that outlasts ``timeout_s`` (a slow constraint may take seconds) is left to finish in
        its daemon thread: a server on SIGTERM must exit within 5 s, and a process exits
        without waiting for it."""
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=timeout_s)
        self.engine.close()

    async def _on_engine_thread(self, method: str, *args):
        self.check_health()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((method, (args, done)))
        return await asyncio.wrap_future(done)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - whatever broke the loop kills the engine
            logger.exception("engine loop died")
            self.dead_error = err
            dead = EngineDeadError(f"the engine loop has stopped: {err!r}")
            for loop, outputs in list(self._streams.values()):
                _deliver(loop, outputs, dead)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished_requests()
            try:
                while True:
                    self._handle(*self._commands.get(block=block))
                    block = False
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            stats = engine.last_stats
            self.metrics.record(stats.scheduler, stats.iteration, stats.spec_decoding)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    _deliver(*stream, output)

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self.engine.add_processed(payload)
            except ValueError as err:  # a request id already in use
                stream = self._streams.get(payload[0].parent_id)
                if stream is not None:
                    _deliver(*stream, err)
        elif kind == "abort":
            self.engine.abort_request(payload)
            self.metrics.record(self.engine.scheduler_stats())
        elif kind in ("sleep", "wake_up"):
            args, done = payload
            try:
                result = getattr(self.engine, kind)(*args)
            except Exception as err:  # noqa: BLE001 - the caller gets it, the engine carries on
                done.set_exception(err)
                return
            if kind == "sleep":
                for output in result:  # the aborted requests: their streams end here
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        _deliver(*stream, output)
                self.metrics.record(self.engine.scheduler_stats())
                result = None
            done.set_result(result)


def _deliver(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(outputs.put_nowait, item)
    except RuntimeError:  # that client's event loop has closed: nobody is listening
        pass
