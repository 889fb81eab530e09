"""Batch extraction: many documents, one schema, one shared instruction. The instruction is
the system prompt, so every request starts with the same tokens: it is prefilled once (a
one-token warm-up request) and every document after that hits the prefix cache for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from agentrt.backend import Backend, Usage
from agentrt.errors import AgentrtError, InvalidRequestError
from agentrt.formats import TEXT, resolve_format
from agentrt.session import Session


@dataclass(slots=True)
class ExtractResult:
    """The outcome for one input: `value` on success, else `error` (the typed exception)."""

    index: int
    value: Any = None
    error: Exception | None = None
    usage: Usage | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def extract_many(
    backend: Backend,
    texts: Sequence[str],
    schema: Any,
    *,
    instructions: str,
    concurrency: int = 32,
    progress: bool = True,
    **sampling: Any,
) -> list[ExtractResult]:
    """Extract `schema` from every text with at most `concurrency` requests in flight.
    Per-item failures (truncation, validation, bad input) are returned, not raised."""
    if concurrency < 1:
        raise InvalidRequestError(
            f"concurrency={concurrency} is invalid: expected >= 1.", field="concurrency"
        )
    fmt = resolve_format(schema)  # a bad schema fails the whole call, once
    texts = list(texts)
    results = [ExtractResult(i) for i in range(len(texts))]
    if not texts:
        return results
    await _warm_prefix(backend, instructions)
    limiter = anyio.CapacityLimiter(concurrency)
    bar = _progress_bar(len(texts), progress)

    async def run(i: int) -> None:
        async with limiter:
            session = Session(backend, system=instructions, **sampling)
            try:
                results[i].value = await session.generate(texts[i], fmt)
                results[i].usage = session.last.usage
            except (AgentrtError, InvalidRequestError) as exc:
                results[i].error = exc
                results[i].usage = getattr(exc, "usage", None)
        if bar is not None:
            bar.update(1)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(run, i)
    finally:
        if bar is not None:
            bar.close()
    return results


async def _warm_prefix(backend: Backend, instructions: str) -> None:
    """Prefill the instruction once so concurrent requests find it in the prefix cache
    instead of all computing it in the same step."""
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "-"}]
    async for _ in backend.stream(messages, TEXT, {"max_tokens": 1}):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="extract", unit="doc")
