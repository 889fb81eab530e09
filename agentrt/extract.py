"""Batch extraction: many documents, one schema, one shared instruction. The instruction is
the system prompt, so every request starts with the same tokens: it is prefilled once (a
one-token warm-up request) and every document after that hits the prefix cache for it.

`extract_iter` streams: it pulls documents from an iterable (or async iterable) only as
requests free up, and yields each result as it finishes, so memory is bounded by the
in-flight window (`concurrency` requests plus as many finished results not yet consumed),
not by the input. `extract_many` collects it into a list in input order."""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from agentrt.backend import Backend, Usage
from agentrt.errors import (
    AgentrtError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    SchemaError,
)
from agentrt.formats import TEXT, OutputFormat, resolve_format
from agentrt.session import Session


@dataclass(frozen=True, slots=True)
class Document:
    """One input: its `id` (the user's, or its row number) and `text`. A row that could not
    be read carries `error` instead of text; it becomes a failed result without a request."""

    id: str | int
    text: str | None
    error: Exception | None = None


@dataclass(slots=True)
class ExtractResult:
    """The outcome for one input: `value` on success, else `error` (the typed exception).
    `index` is the input's position in the stream, `id` its Document id (= `index` for a
    plain string)."""

    index: int
    value: Any = None
    error: Exception | None = None
    usage: Usage | None = None
    id: str | int | None = None
    num_steered_tokens: int = 0  # > 0: the grammar closed the reply at max_tokens

    def __post_init__(self) -> None:
        if self.id is None:
            self.id = self.index

    @property
    def ok(self) -> bool:
        return self.error is None


async def extract_iter(
    backend: Backend,
    documents: Iterable[str | Document] | AsyncIterable[str | Document],
    schema: Any,
    *,
    instructions: str,
    concurrency: int = 32,
    **sampling: Any,
) -> AsyncIterator[ExtractResult]:
    """`async for result in extract_iter(...)`: one result per document, in the order they
    finish. At most `concurrency` requests run at once; the next document is read only when
    one ends. Per-item failures (truncation, validation, bad input) are results, not raised.
    A bad schema raises `SchemaError` before any document is read.

    Stopping early: leave the loop inside `contextlib.aclosing(extract_iter(...))` (or
    cancel the task); requests still in flight are then aborted in the engine."""
    if concurrency < 1:
        raise InvalidRequestError(
            f"concurrency={concurrency} is invalid: expected >= 1.", field="concurrency"
        )
    fmt = resolve_format(schema)  # a bad schema fails the whole call, once
    # Finished results wait here for the consumer; a full buffer holds back the workers,
    # and so the reading of new documents.
    send, receive = anyio.create_memory_object_stream[ExtractResult](concurrency)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_admit, backend, documents, fmt, instructions, concurrency, sampling, send)
        async with receive:
            async for result in receive:
                yield result


async def extract_many(
    backend: Backend,
    texts: Iterable[str | Document] | AsyncIterable[str | Document],
    schema: Any,
    *,
    instructions: str,
    concurrency: int = 32,
    progress: bool = True,
    **sampling: Any,
) -> list[ExtractResult]:
    """Extract `schema` from every text with at most `concurrency` requests in flight; the
    results in input order. Per-item failures (truncation, validation, bad input) are
    returned, not raised."""
    total = len(texts) if hasattr(texts, "__len__") else None
    bar = _progress_bar(total, progress)
    results: list[ExtractResult] = []
    try:
        async for result in extract_iter(
            backend, texts, schema, instructions=instructions, concurrency=concurrency, **sampling
        ):
            results.append(result)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    results.sort(key=lambda r: r.index)
    return results


async def _admit(
    backend: Backend,
    documents: Iterable[str | Document] | AsyncIterable[str | Document],
    fmt: OutputFormat,
    instructions: str,
    concurrency: int,
    sampling: dict[str, Any],
    send: anyio.abc.ObjectSendStream[ExtractResult],
) -> None:
    """Read documents one free slot at a time and start a request for each; closes `send`
    once every request has delivered its result."""
    limiter = anyio.Semaphore(concurrency)
    warmed = False

    async def run(index: int, document: str | Document) -> None:
        try:
            result = await _extract_one(backend, index, document, fmt, instructions, sampling)
            await send.send(result)
        finally:
            limiter.release()

    # The task group ends (every request delivered) before `send` closes.
    async with send, anyio.create_task_group() as tg:
        index = 0
        async for document in _aiter(documents):
            await limiter.acquire()
            if not warmed:  # only once there is a document: an empty input costs nothing
                await _warm_prefix(backend, instructions)
                warmed = True
            tg.start_soon(run, index, document)
            index += 1


async def _extract_one(
    backend: Backend,
    index: int,
    document: str | Document,
    fmt: OutputFormat,
    instructions: str,
    sampling: dict[str, Any],
) -> ExtractResult:
    if isinstance(document, Document):
        result = ExtractResult(index, id=document.id)
        if document.error is not None:
            result.error = document.error
            return result
        text = document.text
    else:
        result = ExtractResult(index)
        text = document
    if not isinstance(text, str):
        result.error = InvalidRequestError(
            f"document {result.id!r}: expected a string, got {type(text).__name__}.",
            field="input",
        )
        return result
    session = Session(backend, system=instructions, **sampling)
    try:
        result.value = await session.generate(text, fmt)
        result.usage = session.last.usage
        result.num_steered_tokens = session.last.num_steered_tokens
    except EngineDeadError:
        raise  # every later request would fail too: stop the whole run
    except (AgentrtError, EngineError) as exc:
        result.error = exc
        result.usage = getattr(exc, "usage", None)
    return result


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _warm_prefix(backend: Backend, instructions: str) -> None:
    """Prefill the instruction once so concurrent requests find it in the prefix cache
    instead of all computing it in the same step."""
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "-"}]
    async for _ in backend.stream(messages, TEXT, {"max_tokens": 1}):
        pass


def _progress_bar(total: int | None, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="extract", unit="doc")


def load_schema(spec: str) -> Any:
    """`pkg.module:Name` (a Pydantic model or type) or the path of a JSON-schema file."""
    if ":" in spec and not Path(spec).exists():
        module_name, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise SchemaError(f"cannot load the schema {spec!r}: {exc}") from None
    try:
        return json.loads(Path(spec).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SchemaError(
            f"--schema {spec!r} is neither pkg.module:Name nor a JSON-schema file: {exc}"
        ) from None
