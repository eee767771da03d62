"""AsyncEngine: one thread steps the LLMEngine for every live request; asyncio callers stream outputs.

```
 asyncio loop (HTTP handlers)                 engine thread (owns the LLMEngine)
   add_request ──► _Add ──► command queue ──► add_request / abort_request
   RequestStream ◄── _dispatch(outputs) ◄──── step() ◄──┘   (one batch for all live requests)
```

Requests join the running batch between steps (continuous batching). Only the engine thread calls
the engine; the loop side reads the `stats` snapshot it publishes after every step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvforge.engine.engines import Engine
from kvforge.engine.prompts import PromptType
from kvforge.engine.stats import EngineStats
from kvforge.lora.request import LoRARequest
from kvforge.outputs import PoolingRequestOutput, RequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many sequences wait for a batch slot; the request was not queued. Retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (it crashed or was shut down); no request can run."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    ack: asyncio.Future
    lora: LoRARequest | None = None


@dataclass(slots=True)
class _AddLoRA:
    lora: LoRARequest
    ack: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


_STOP = object()


class RequestStream:
    """The outputs of one request, as an async iterator.

    Outputs are cumulative (full text and tokens so far), so only the newest one is kept: a slow
    reader skips intermediate outputs and loses nothing. Cancelling a reader, or `abort()`, aborts
    the request in the engine, which frees its KV blocks.
    """

    def __init__(self, request_id: str, on_abort: Callable[[str], None], ack: asyncio.Future) -> None:
        self.request_id = request_id
        self.ack = ack  # resolved by the engine thread once the request is queued (or refused)
        self._on_abort = on_abort
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def abort(self) -> None:
        """Stop the request unless it already ended; safe to call any number of times."""
        if not self._done:
            self._done = True
            self._on_abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self.abort()
            raise
        self._ready.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        output = self._latest
        assert output is not None
        self._done = output.finished
        return output


class AsyncEngine:
    """Serves concurrent asyncio callers from one LLMEngine (or PoolingEngine), stepped by a background thread.

    `max_queue` bounds the sequences waiting for a batch slot (those beyond the batch's max_num_seqs,
    a request's n samples counted together): beyond it `add_request` raises EngineOverloadedError.
    If the engine thread dies, every pending request fails with EngineDeadError (chained to the
    cause) and so does every later one.
    """

    def __init__(self, engine: Engine, max_queue: int = 1024) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine  # NOTE: after start(), only the engine thread may call it
        self.tokenizer = engine.tokenizer  # thread-safe: encoding and decoding only
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        self.vocab_size = engine.vocab_size
        self.max_queue = max_queue
        self.stats: EngineStats = engine.stats()
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- the asyncio side --------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; outputs are delivered on the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread after its current step (pending requests fail with EngineDeadError), then release
        the engine: its model, KV cache, compiled graphs, threads and the other ranks' processes. Also after the
        thread died, or when it never started."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            await asyncio.sleep(0)  # let the thread's last callbacks run
        self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def num_compiling(self) -> int:
        """Decode batch sizes compiling in the background (the engine answers this from any thread)."""
        return self.engine.num_compiling()

    async def add_lora(self, lora: LoRARequest) -> None:
        """Read and check a LoRA adapter on the engine thread (ValueError naming a bad one)."""
        if self._loop is None:
            raise RuntimeError("call start() before adding adapters")
        if self.error is not None:
            raise EngineDeadError(str(self.error)) from self.error.__cause__
        ack = self._loop.create_future()
        self._commands.put(_AddLoRA(lora, ack))
        await ack

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams, lora: LoRARequest | None = None) -> RequestStream:
        """Queue a request (with a LoRA adapter, if given); returns once the engine has taken it. Raises ValueError
        for a bad request, EngineOverloadedError when the queue is full and EngineDeadError when the engine is
        gone."""
        if self._loop is None:
            raise RuntimeError("call start() before adding requests")
        if self.error is not None:
            raise EngineDeadError(str(self.error)) from self.error.__cause__
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        # a grammar compiles in the engine's grammar threads, not its step loop
        if isinstance(params, SamplingParams) and params.structured_output is not None:
            await asyncio.wrap_future(self.engine.grammars.compile(params.structured_output))
        stream = RequestStream(request_id, self._abort, self._loop.create_future())
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, params, stream.ack, lora))
        try:
            await stream.ack
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; closing early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.error is None:
            self._commands.put(_Abort(request_id))

    def _dispatch(self, outputs: list[RequestOutput] | list[PoolingRequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    @staticmethod
    def _resolve(ack: asyncio.Future, error: BaseException | None) -> None:
        if ack.done():  # the caller went away; its abort follows the add in the command queue
            return
        if error is None:
            ack.set_result(None)
        else:
            ack.set_exception(error)

    def _on_stopped(self, cause: BaseException | None) -> None:
        message = "the engine was shut down" if cause is None else f"the engine loop died: {cause!r}"
        self.error = _dead(message, cause)
        for stream in self._streams.values():
            if stream.ack.done():
                stream.fail(_dead(message, cause))
            else:
                stream.ack.set_exception(_dead(message, cause))
        self._streams.clear()

    # ---- the engine thread -------------------------------------------------------------------
    def _call(self, callback: Callable, *args: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._call(self._dispatch, outputs)
                self.stats = self.engine.stats()
        except BaseException as error:
            logger.exception("the engine loop died; failing every pending request")
            self._call(self._on_stopped, error)
            return
        self._call(self._on_stopped, None)

    def _take_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if block); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, _AddLoRA):
                self._call(self._resolve, command.ack, self._add_lora(command.lora))
            else:
                self._call(self._resolve, command.ack, self._add(command))

    def _add(self, command: _Add) -> BaseException | None:
        # NOTE: a sequence waits for a batch slot when the batch's max_num_seqs slots are taken; all n
        # samples of the request are counted at once (the sequences just added, not yet scheduled, too).
        num_slots = self.engine.config.scheduler.max_num_seqs
        num_queued = self.engine.stats().num_unfinished + command.params.n - num_slots
        if num_queued > self.max_queue:
            return EngineOverloadedError(f"the server is overloaded: {num_queued} sequences would wait for one "
                                         f"of the {num_slots} batch slots (max queue {self.max_queue}); retry later")
        lora = {} if command.lora is None else {"lora_request": command.lora}
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, **lora)
        except ValueError as error:
            return error
        return None

    def _add_lora(self, lora: LoRARequest) -> BaseException | None:
        try:
            self.engine.add_lora(lora)
        except ValueError as error:
            return error
        return None


def _dead(message: str, cause: BaseException | None) -> EngineDeadError:
    error = EngineDeadError(message)
    error.__cause__ = cause
    return error
