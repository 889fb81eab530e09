"""AsyncEngine: the engine behind an async API (anyio, so asyncio and trio both work).

Threads, processes and ownership:
- An engine-core client (`engine/client/core_client.py`) owns the engine: `InprocClient` runs the
  `LLMEngine` on a background thread; `MPClient` (`engine_process=True`, or
  `data_parallel_size` > 1) runs each engine core in its own process behind a client thread.
  The event loop talks to either through a command queue (add / abort / call / stop).
- The front end (event loop) validates and tokenizes requests with its own copy of the
  tokenizer, so a bad request raises in the caller at once and no two threads share a Rust
  tokenizer.
- One pump task moves each step's deltas from a bounded queue (backpressure on the engine)
  to the per-request streams. A fault in the engine (or a dead core process) fails every
  pending request with `EngineDeadError` and refuses new ones; nothing hangs.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import anyio

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.core_client import (
    AbortRequests,
    AddRequest,
    CallEngine,
    CallUtility,
    EngineCoreClient,
    InprocClient,
    LoopStopped,
    RequestFailed,
    StopEngine,
)
from agentrt.engine.client.llm_engine import LLMEngine
from agentrt.engine.client.outputs import RequestDelta, RequestOutput
from agentrt.engine.client.processor import Processor
from agentrt.engine.config import EngineConfig
from agentrt.engine.core.scheduler import SchedulerStats
from agentrt.engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
)
from agentrt.engine.sampling_params import SamplingParams


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
    """`async with AsyncEngine(model=None, **options) as engine:` starts the engine (loads
    the model, or takes a built `LLMEngine` via `engine=`) and runs its loop; leaving the
    block (in the same task) aborts what still runs and stops it.

    `options` are the fields of `EngineArgs`. `engine_process=True` runs the engine core in
    its own process, `data_parallel_size=N` runs N of them behind this front end (routed by
    load and prefix-cache affinity); by default it runs on a thread of this process.
    `max_waiting_requests` bounds the requests that may wait beyond the `max_num_seqs` that
    run at once; past it `add_request` raises `EngineOverloadedError`. With a built
    `engine=`, it is the one option that applies.
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
        self.max_waiting_requests = (
            engine.args.max_waiting_requests
            if engine is not None and "max_waiting_requests" not in options
            else self.args.max_waiting_requests
        )
        self.client: EngineCoreClient
        if self.args.create_parallel_config().uses_engine_process:
            from agentrt.engine.client.mp_client import MPClient

            self.client = MPClient(self.args)
        else:
            self.client = InprocClient(self.args, engine)
        self._streams: dict[str, RequestStream] = {}
        self._req_counter = itertools.count()
        self._started = False
        self._task_group = None
        self._dead: EngineDeadError | None = None
        self._accepting = False
        self.tokenizer = None
        self.processor: Processor | None = None
        self.config: EngineConfig | None = None  # the engine's resolved config, once started

    @property
    def engine(self) -> LLMEngine | None:
        """The `LLMEngine`, when it runs in this process (None with an engine process)."""
        return self.client.engine

    @property
    def model_path(self) -> str:
        return str(self.config.model.path)

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        built = self.client.start()
        self._started = True
        try:
            front_end = await anyio.to_thread.run_sync(built.result)  # the build error, if any
        except BaseException:
            self.client.put(StopEngine())  # cancelled while building: end the thread
            raise
        self.config = front_end.config
        self.tokenizer = front_end.tokenizer
        self.processor = Processor.for_engine(self.config, self.tokenizer)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._pump)
        self._accepting = True
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort what is still running, stop the engine, and fail open streams."""
        if self._task_group is None:
            return
        self._accepting = False
        self.client.put(StopEngine())
        task_group, self._task_group = self._task_group, None
        await task_group.__aexit__(None, None, None)  # the pump returns on LoopStopped
        await anyio.to_thread.run_sync(self.client.join)

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
        self.client.put(AddRequest(request, text))
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
            self.client.put(AbortRequests([request_id]))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(llm_engine)` on the engine thread, between steps, and return its result
        (the only safe way to read or change engine state while the loop runs). Only an
        in-process engine runs Python functions: with an engine process, use the named
        calls (`stats`, `reset_prefix_cache`)."""
        self._check_alive()
        if self.engine is None:
            raise ConfigError(
                "call(fn) runs a function on an in-process engine; this one runs in an engine "
                "process (engine_process=True or data_parallel_size > 1): use stats() or "
                "reset_prefix_cache()."
            )
        future: Future = Future()
        self.client.put(CallEngine(fn, future))
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    async def stats(self) -> SchedulerStats:
        """The scheduler's counters (summed over the replicas with data parallelism)."""
        return await self._call_utility("stats")

    async def replica_stats(self) -> list[SchedulerStats]:
        """The scheduler's counters of each data-parallel replica (one with a single core)."""
        return await self._call_utility("stats", per_replica=True)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in every replica."""
        await self._call_utility("reset_prefix_cache")

    async def _call_utility(self, name: str, per_replica: bool = False) -> Any:
        self._check_alive()
        future: Future = Future()
        self.client.put(CallUtility(name, future, per_replica))
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if not self._started:
            raise EngineDeadError(
                "the engine is not running: use `async with AsyncEngine(...) as engine:`."
            )

    def _check_accepting(self) -> None:
        self._check_alive()
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down and admits no new requests.")
        replicas = self.config.parallel.data_parallel_size
        limit = self.config.scheduler.max_num_seqs * replicas + self.max_waiting_requests
        if len(self._streams) >= limit:
            raise EngineOverloadedError(
                f"{len(self._streams)} requests are pending (limit {limit}: max_num_seqs per "
                "replica + max_waiting_requests); retry later."
            )

    # -- event loop side ---------------------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            item = await anyio.to_thread.run_sync(self.client.get, abandon_on_cancel=True)
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
        if isinstance(error, EngineDeadError):  # a dead core process says so itself
            self._dead = error
        elif error is not None:
            self._dead = EngineDeadError(f"the engine loop failed: {error!r}")
            self._dead.__cause__ = error
        else:
            self._dead = EngineDeadError("the engine was shut down.")
        for stream in self._streams.values():
            stream._fail(self._dead)
        self._streams.clear()
