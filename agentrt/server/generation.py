"""The engine requests behind one API request, and how they reach the client.

A `Generation` is the n choices of a chat request (or prompts x n for completions), one
engine request each. It is always consumed under a disconnect watcher: when the client goes
away, streaming or not, the consuming tasks are cancelled, which aborts the engine requests
and frees their KV blocks at once. `EventStreamResponse` sends server-sent events from
tasks that live inside the response itself (structured concurrency: nothing outlives it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response

from agentrt.engine.async_engine import AsyncEngine, RequestStream
from agentrt.engine.outputs import RequestDelta, RequestOutput
from agentrt.engine.sampling_params import SamplingParams
from agentrt.server.errors import APIError, from_exception
from agentrt.server.metrics import RequestTimer, ServerMetrics

Emit = Callable[[Any], Awaitable[None]]


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
    ) -> None:
        """Queue one engine request per (prompt, params) pair: `prompts[i]` goes with
        `params[i]`. If one is refused (bad input, queue full) the others are aborted."""
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
        except BaseException:
            self.abort()
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

        async def run_all() -> None:
            async with anyio.create_task_group() as tg:
                for i in range(len(self.streams)):
                    tg.start_soon(run, i)

        await until_disconnect(receive, run_all, on_disconnect=self.abort)
        return outputs

    async def first_deltas(self, receive) -> list[RequestDelta]:
        """Wait for each choice's first delta (its first token, or its end): a request that
        fails before producing anything, e.g. a schema that does not compile, is still
        answered with an error status instead of a broken stream."""
        firsts: list[RequestDelta | None] = [None] * len(self.streams)

        async def run_all() -> None:
            async with anyio.create_task_group() as tg:
                for i in range(len(self.streams)):
                    tg.start_soon(_first, i)

        async def _first(i: int) -> None:
            firsts[i] = await self.next_delta(i)

        await until_disconnect(receive, run_all, on_disconnect=self.abort)
        return firsts


def structured_failure(outputs: Sequence[RequestOutput]) -> APIError | None:
    """A 400 for requests the engine ended with an error (a grammar that failed to compile,
    or an output that cannot satisfy the schema): both come from the request's schema."""
    for output in outputs:
        if output.outputs[0].finish_reason == "error":
            return APIError(
                400,
                f"the output constraint failed: {output.error}",
                code="structured_output_failed",
            )
    return None


async def respond(generation: Generation, view, request, receive) -> Response:
    """The response of a chat or completions request: a stream of events (headers go out
    after the first token, so a schema that fails to compile is still a 400) or one JSON
    body. `view` renders outputs: `stream(generation, firsts, emit, include_usage)` and
    `completion(outputs)`."""
    if request.stream:
        firsts = await generation.first_deltas(receive)
        failure = structured_failure([d.output for d in firsts if d.output is not None])
        if failure is not None:
            raise failure
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return EventStreamResponse(
            lambda emit: view.stream(generation, firsts, emit, include_usage), generation.abort
        )
    outputs = await generation.collect(receive)
    failure = structured_failure(outputs)
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


class EventStreamResponse(Response):
    """`text/event-stream` written by `produce(emit)`: each `await emit(obj)` sends one
    `data: <json>` event (a `str` is sent as is), then `data: [DONE]` ends the stream. A
    client disconnect cancels `produce`, and `on_disconnect` runs (it aborts the engine
    requests that `produce` was reading)."""

    def __init__(
        self, produce: Callable[[Emit], Awaitable[None]], on_disconnect: Callable[[], None]
    ) -> None:
        # No Response.__init__: it would add `content-length: 0` for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        self.produce = produce
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        lock = anyio.Lock()

        async def emit(event: Any) -> None:
            data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
            async with lock:
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"data: {data}\n\n".encode(),
                        "more_body": True,
                    }
                )

        try:
            await until_disconnect(
                receive, lambda: self.produce(emit), on_disconnect=self.on_disconnect
            )
        except ClientDisconnected:
            return
        except Exception as exc:  # the status line is sent: report it as an event
            self.on_disconnect()
            await emit(from_exception(exc).body())
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
