"""The engine requests behind one API request, and how they reach the client.

A `Generation` is the n choices of a chat request (or prompts x n for completions), one
engine request each. It is always consumed under a disconnect watcher: when the client goes
away, streaming or not, the consuming tasks are cancelled, which aborts the engine requests
and frees their KV blocks at once. `event_stream` sends server-sent events (sse-starlette)
from tasks that live inside the response itself (structured concurrency: nothing outlives
it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse, Response

from agentrt.engine.client.async_engine import AsyncEngine, RequestStream
from agentrt.engine.client.outputs import RequestDelta, RequestOutput
from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.server.errors import failed_output, from_exception
from agentrt.server.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger("agentrt.server")

Emit = Callable[[Any], Awaitable[None]]


def _release_remote_prefill(engine: AsyncEngine, params: Sequence[SamplingParams]) -> None:
    """A request refused before it reached the engine (too long for this instance, the
    queue full) that came with a producer's signed `kv_transfer_params` (a disaggregated
    decode): tell the producer to free what it holds for it now, on a thread (nothing waits
    for it). Otherwise the blocks stay pinned until the producer's hold timeout, and a few
    such requests fill its cap."""
    kv = params[0].kv_transfer_params if params else None
    engine_config = getattr(engine, "config", None)  # None before start (and in fakes)
    config = getattr(engine_config, "kv_transfer", None)
    if not kv or not kv.get("do_remote_prefill") or config is None or config.secret is None:
        return
    from agentrt.engine.kv_transfer.p2p_worker import release_hold

    def release() -> None:
        try:
            release_hold(kv, config.secret, config.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the producer's hold timeout frees them anyway
            logger.info("could not release a refused request's remote prefill: %s", exc)

    threading.Thread(target=release, name="agentrt-kv-release", daemon=True).start()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


class Generation:
    """Engine requests started together; `streams[i]` is choice i (prompt-major order)."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        *,
        priority: int = 0,
        param_names: dict[str, str] | None = None,
    ) -> None:
        """Queue one engine request per (prompt, params) pair: `prompts[i]` goes with
        `params[i]`. If one is refused (bad input, queue full) the others are aborted, and
        the error names the request's field (`param_names`: engine field -> request's)."""
        arrival = time.monotonic()
        self.engine = engine
        self.prompt_lens = [len(p) for p in prompts]
        self.streams: list[RequestStream] = []
        self.timers: list[RequestTimer] = []
        try:
            for prompt_ids, choice_params in zip(prompts, params, strict=True):
                stream = engine.add_request(prompt_ids, choice_params, priority=priority)
                self.streams.append(stream)
                self.timers.append(metrics.timer(arrival))
        except InvalidRequestError as exc:
            self.abort()
            _release_remote_prefill(engine, params)
            raise from_exception(exc, param_names) from None
        except BaseException:
            self.abort()
            _release_remote_prefill(engine, params)
            raise

    def abort(self) -> None:
        """Abort every choice still running (the client left, or a sibling was refused)."""
        for stream, timer, prompt_len in zip(
            self.streams, self.timers, self.prompt_lens, strict=False
        ):
            self.engine.abort(stream.request_id)
            timer.on_finish("abort", prompt_len)

    async def next_delta(self, i: int) -> RequestDelta:
        """The next delta of choice i (raises StopAsyncIteration after the last)."""
        delta = await self.streams[i].__anext__()
        self.timers[i].on_tokens(len(delta.token_ids))
        if delta.output is not None:
            self.timers[i].on_finish(delta.output.outputs[0].finish_reason, self.prompt_lens[i])
        return delta

    async def collect(self, receive) -> list[RequestOutput]:
        """Run every choice to the end; raises `ClientDisconnected` (after aborting) when
        the client leaves first."""
        outputs: list[RequestOutput | None] = [None] * len(self.streams)

        async def run(i: int) -> None:
            while outputs[i] is None:
                delta = await self.next_delta(i)
                outputs[i] = delta.output

        await until_disconnect(receive, lambda: self._each_choice(run), on_disconnect=self.abort)
        return outputs

    async def first_deltas(self, receive) -> list[RequestDelta]:
        """Wait for each choice's first delta (its first token, or its end): a request that
        fails before producing anything, e.g. a schema that does not compile, is still
        answered with an error status instead of a broken stream."""
        firsts: list[RequestDelta | None] = [None] * len(self.streams)

        async def first(i: int) -> None:
            firsts[i] = await self.next_delta(i)

        await until_disconnect(receive, lambda: self._each_choice(first), on_disconnect=self.abort)
        return firsts

    async def stream_choices(
        self,
        firsts: list[RequestDelta],
        emit: Emit,
        on_delta: Callable[[int, RequestDelta], Awaitable[None]],
        on_finish: Callable[[int, RequestOutput], Awaitable[None]] | None = None,
    ) -> list[RequestOutput]:
        """Stream every choice concurrently, from its first delta: `on_delta(i, delta)`
        emits what each delta of choice i adds (the last one carries the output); then a
        failed choice's error event is emitted, or `on_finish(i, output)` runs for one
        that succeeded. Returns the outputs."""
        outputs: list[RequestOutput | None] = [None] * len(firsts)

        async def run(i: int) -> None:
            delta = firsts[i]
            await on_delta(i, delta)
            while delta.output is None:
                delta = await self.next_delta(i)
                await on_delta(i, delta)
            outputs[i] = delta.output
            failure = failed_output([delta.output])
            if failure is not None:
                await emit(failure.body())
            elif on_finish is not None:
                await on_finish(i, delta.output)

        await self._each_choice(run)
        return outputs

    async def _each_choice(self, fn: Callable[[int], Awaitable[None]]) -> None:
        """`fn(i)` for every choice, concurrently."""
        async with anyio.create_task_group() as tg:
            for i in range(len(self.streams)):
                tg.start_soon(fn, i)


async def respond(generation: Generation, view, request, receive) -> Response:
    """The response of a chat or completions request: a stream of events (headers go out
    after the first token, so a schema that fails to compile is still a 400) or one JSON
    body. `view` renders outputs: `stream(generation, firsts, emit, include_usage)` and
    `completion(outputs)`."""
    if request.stream:
        firsts = await generation.first_deltas(receive)
        failure = failed_output([d.output for d in firsts if d.output is not None])
        if failure is not None:
            raise failure
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return event_stream(
            lambda emit: view.stream(generation, firsts, emit, include_usage), generation.abort
        )
    outputs = await generation.collect(receive)
    failure = failed_output(outputs)
    if failure is not None:
        raise failure
    return JSONResponse(view.completion(outputs))


async def until_disconnect(receive, fn, *, on_disconnect: Callable[[], None]) -> None:
    """Run `fn()` while watching the connection; if the client disconnects first, cancel
    it, call `on_disconnect()` and raise `ClientDisconnected`. Errors of `fn` propagate
    unwrapped."""
    disconnected = False
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            await fn()
        except Exception as exc:  # re-raised below, outside the task group (no group)
            error = exc
        tg.cancel_scope.cancel()
    if disconnected:
        on_disconnect()
        raise ClientDisconnected
    if error is not None:
        raise _unwrap(error)


def _unwrap(error: BaseException) -> BaseException:
    """The first real error in a (nested) exception group: n choices failing together fail
    for the same reason."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def event_stream(
    produce: Callable[[Emit], Awaitable[None]], on_end: Callable[[], None]
) -> EventSourceResponse:
    """`text/event-stream` written by `produce(emit)`: each `await emit(obj)` sends one
    `data: <json>` event (a `str` is sent as is), then `data: [DONE]` ends the stream. An
    error of `produce` is sent as an error event (the status line is already out). `produce`
    runs in the response's task group, so a client disconnect cancels it; `on_end` runs
    however it ends (it aborts the engine requests `produce` was reading, if still running).
    """
    send, receive = anyio.create_memory_object_stream[str]()  # unbuffered: backpressure

    async def emit(event: Any) -> None:
        await send.send(event if isinstance(event, str) else json.dumps(event, ensure_ascii=False))

    async def run() -> None:
        async with send:
            error = None
            try:
                await produce(emit)
            except Exception as exc:
                error = from_exception(exc).body()
            finally:
                on_end()
            if error is not None:
                await emit(error)
            await emit("[DONE]")

    return EventSourceResponse(receive, data_sender_callable=run, sep="\n")
