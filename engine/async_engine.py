"""AsyncEngine: the engine loop on a background thread, behind an async API (anyio, so asyncio
and trio both work).

Threads and ownership:
- The engine thread owns the `LLMEngine`: it alone adds, aborts and steps requests. The event
  loop talks to it through a command queue (add / abort / call / stop).
- The front end (event loop) validates and tokenizes requests with its own copy of the
  tokenizer, so a bad request raises in the caller at once and the two threads never share a
  Rust tokenizer.
- One pump task moves each step's deltas from a bounded queue (backpressure on the engine)
  to the per-request streams. A fault in the engine thread fails every pending request with
  `EngineDeadError` and refuses new ones; nothing hangs.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio

from agentrt.engine.args import EngineArgs
from agentrt.engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from agentrt.engine.llm_engine import LLMEngine
from agentrt.engine.outputs import RequestDelta, RequestOutput
from agentrt.engine.records import EngineCoreRequest
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import SchedulerStats

_MAX_QUEUED_STEPS = 64  # engine steps waiting for the pump before the engine thread blocks


# Commands from the event loop to the engine thread.


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineCoreRequest
    prompt: str | None  # the prompt's text, when it had one


@dataclass(frozen=True, slots=True)
class AbortRequests:
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Run `fn(llm_engine)` between steps; its result or error goes to `future`."""

    fn: Callable[[LLMEngine], Any]
    future: Future


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Abort every request and end the loop."""


EngineCommand = AddRequest | AbortRequests | CallEngine | StopEngine

# What the engine thread hands the pump besides each step's deltas.


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """One request could not be added; the engine goes on."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class LoopStopped:
    """The loop ended; `error` is the fault that ended it, if any."""

    error: BaseException | None


class RequestStream:
    """The deltas of one request, in order, ending with the one that carries the complete
    `RequestOutput`. Cancelling the task that awaits it, or `aclose()`, aborts the request in
    the engine and frees its KV blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._deltas: deque[RequestDelta] = deque()
        self._event = anyio.Event()
        self._error: BaseException | None = None
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        while not self._deltas:
            if self._error is not None:
                self._done = True
                raise self._error
            self._event = anyio.Event()
            try:
                await self._event.wait()
            except BaseException:  # cancelled: the request must not keep running
                self._close()
                raise
        delta = self._deltas.popleft()
        if delta.finished:
            self._done = True
            self._engine._streams.pop(self.request_id, None)
        return delta

    async def result(self) -> RequestOutput:
        """Wait for the end and return the complete output."""
        async for delta in self:
            if delta.output is not None:
                return delta.output
        raise EngineDeadError(f"request {self.request_id} ended without an output")

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def _put(self, delta: RequestDelta) -> None:
        self._deltas.append(delta)
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()


class AsyncEngine:
    """`async with AsyncEngine(model=None, **options) as engine:` starts the engine
    thread, which loads the model (or takes a built `LLMEngine` via `engine=`) and runs the
    loop; leaving the block (in the same task) aborts what still runs and stops it.

    The model is built on the engine thread itself: torch's OpenMP runtime keeps a team of
    worker threads per thread that ran parallel work, and with more of them alive than cores
    it stops spin-waiting between parallel regions, which made every step ~15% slower.

    `options` are the fields of `EngineArgs`. `max_waiting_requests` bounds the requests that
    may wait beyond the `max_num_seqs` that run at once; past it `add_request` raises
    `EngineOverloadedError`. With a built `engine=`, it is the one option that applies.
    """

    def __init__(
        self, model: str | None = None, *, engine: LLMEngine | None = None, **options: Any
    ) -> None:
        self.args = EngineArgs.from_options(model, **options)
        ignored = sorted(set(options) - {"max_waiting_requests"})
        if engine is not None and (model is not None or ignored):
            raise ConfigError(
                "engine= runs an engine that is already built: of the engine options only "
                f"max_waiting_requests applies (got model={model!r} and {ignored})."
            )
        self.engine = engine
        self.max_waiting_requests = (
            engine.args.max_waiting_requests
            if engine is not None and "max_waiting_requests" not in options
            else self.args.max_waiting_requests
        )
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._outputs: queue.Queue = queue.Queue(maxsize=_MAX_QUEUED_STEPS)
        self._streams: dict[str, RequestStream] = {}
        self._req_counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._task_group = None
        self._dead: EngineDeadError | None = None
        # Guards `_loop_exited` against `call()`: a call queued after the loop exited would
        # never be answered, so the exiting loop fails queued calls under this lock.
        self._call_lock = threading.Lock()
        self._loop_exited = False
        self._accepting = False
        self.tokenizer = None
        self.processor = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        built: Future = Future()
        self._thread = threading.Thread(
            target=self._run_loop, args=(built,), name="agentrt-engine", daemon=True
        )
        self._thread.start()
        try:
            await anyio.to_thread.run_sync(built.result)  # the build error, if any
        except BaseException:
            self._commands.put(StopEngine())  # cancelled while building: end the thread
            raise
        self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        self.processor = self.engine.make_processor(self.tokenizer)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._pump)
        self._accepting = True
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort what is still running, stop the engine thread, and fail open streams."""
        if self._task_group is None:
            return
        self._accepting = False
        self._commands.put(StopEngine())
        task_group, self._task_group = self._task_group, None
        await task_group.__aexit__(None, None, None)  # the pump returns on LoopStopped
        await anyio.to_thread.run_sync(self._thread.join)

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting requests and wait up to `timeout_s` for running ones to finish;
        returns how many were still unfinished (and are aborted when the engine closes)."""
        self._accepting = False
        with anyio.move_on_after(timeout_s):
            while self._streams and self._dead is None:
                await anyio.sleep(0.02)
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def num_pending_requests(self) -> int:
        return len(self._streams)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and queue one request: a prompt (text or token ids) or chat `messages`
        (rendered with the model's chat template, which also gets `tools`). Raises `InvalidRequestError` for bad
        input, `EngineOverloadedError` when the waiting queue is full, `EngineDeadError`
        when the engine has stopped."""
        self._check_accepting()
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{next(self._req_counter)}"
        elif request_id in self._streams:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already running: ids must be unique.",
                field="request_id",
                value=request_id,
            )
        if (prompt is None) == (messages is None):
            raise InvalidRequestError(
                "pass exactly one of prompt and messages.", field="prompt", value=prompt
            )
        text: str | None
        if messages is not None:
            prompt = self.processor.chat_token_ids(messages, tools=tools)
            text = self.tokenizer.decode(prompt)
        else:
            text = prompt if isinstance(prompt, str) else None
        request = self.processor.process(request_id, prompt, params, priority=priority)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._commands.put(AddRequest(request, text))
        return stream

    async def generate(
        self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None, **kw
    ) -> RequestOutput:
        """Run one request to the end (`add_request` options) and return its output."""
        async with self.add_request(prompt, params, **kw) as stream:
            return await stream.result()

    def abort(self, request_id: str) -> None:
        """Abort a request in any state; unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and self._dead is None:
            self._commands.put(AbortRequests([request_id]))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(llm_engine)` on the engine thread, between steps, and return its result
        (the only safe way to read or change engine state while the loop runs)."""
        self._check_alive()
        future: Future = Future()
        with self._call_lock:
            if self._loop_exited:
                raise self._dead or EngineDeadError("the engine loop has stopped.")
            self._commands.put(CallEngine(fn, future))
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    async def stats(self) -> SchedulerStats:
        return await self.call(lambda engine: engine.stats())

    async def reset_prefix_cache(self) -> None:
        await self.call(lambda engine: engine.reset_prefix_cache())

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            raise EngineDeadError(
                "the engine is not running: use `async with AsyncEngine(...) as engine:`."
            )

    def _check_accepting(self) -> None:
        self._check_alive()
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down and admits no new requests.")
        limit = self.engine.scheduler_config.max_num_seqs + self.max_waiting_requests
        if len(self._streams) >= limit:
            raise EngineOverloadedError(
                f"{len(self._streams)} requests are pending (limit {limit}: max_num_seqs + "
                "max_waiting_requests); retry later."
            )

    # -- engine thread -----------------------------------------------------------------------

    def _run_loop(self, built: Future) -> None:
        try:
            if self.engine is None:
                self.engine = LLMEngine(**dataclasses.asdict(self.args))
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(None)
        engine = self.engine
        error: BaseException | None = None
        try:
            while self._handle_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    deltas = engine.step()
                    if deltas:
                        self._outputs.put(deltas)
        except BaseException as exc:  # a fault: the pump fails every pending request
            error = exc
        finally:
            with self._call_lock:
                self._loop_exited = True
                self._fail_queued_calls()
            self._outputs.put(LoopStopped(error))

    def _fail_queued_calls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, CallEngine):
                command.future.set_exception(EngineDeadError("the engine loop has stopped."))

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when the engine is idle); False on stop."""
        engine = self.engine
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            match command:
                case AddRequest(request, prompt):
                    try:
                        engine.add_request(request, prompt)
                    except Exception as exc:  # this request is bad, not the engine
                        engine.abort_requests([request.req_id])
                        self._outputs.put(RequestFailed(request.req_id, exc))
                case AbortRequests(req_ids):
                    deltas = engine.abort_requests(req_ids)
                    if deltas:
                        self._outputs.put(deltas)
                case CallEngine(fn, future):
                    try:
                        future.set_result(fn(engine))
                    except Exception as exc:
                        future.set_exception(exc)
                case StopEngine():
                    engine.abort_all()
                    return False

    # -- event loop side ---------------------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            item = await anyio.to_thread.run_sync(self._outputs.get, abandon_on_cancel=True)
            if isinstance(item, LoopStopped):
                self._on_stopped(item.error)
                return
            if isinstance(item, RequestFailed):
                stream = self._streams.pop(item.request_id, None)
                if stream is not None:
                    error = EngineError(f"request {item.request_id} failed: {item.error!r}")
                    error.__cause__ = item.error
                    stream._fail(error)
                continue
            for delta in item:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream._put(delta)

    def _on_stopped(self, error: BaseException | None) -> None:
        self._accepting = False
        if error is not None:
            self._dead = EngineDeadError(f"the engine loop failed: {error!r}")
            self._dead.__cause__ = error
        else:
            self._dead = EngineDeadError("the engine was shut down.")
        for stream in self._streams.values():
            stream._fail(self._dead)
        self._streams.clear()
