"""Batch extraction: many documents, one schema, one shared instruction. The instruction is
the system prompt, so every request starts with the same tokens: it is prefilled once (a
one-token warm-up request) and every document after that hits the prefix cache for it."""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from agentrt.backend import Backend, Usage
from agentrt.errors import AgentrtError, InvalidRequestError, SchemaError, code_of
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


# -- the `agentrt extract` command's files ------------------------------------------------------


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


def read_documents(path: str, text_field: str) -> list[str]:
    """One document per non-empty JSONL line: a JSON string, or an object's `text_field`."""
    texts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{number}: not JSON: {exc}", field="input") from None
        text = item.get(text_field) if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{path}:{number}: expected a string or an object with a {text_field!r} string.",
                field="input",
            )
        texts.append(text)
    return texts


def write_results(path: str, results: list[ExtractResult]) -> None:
    """One JSON line per result, in input order: {"index", "value", "error"}; an error is
    {"type", "code", "message"} (`code`: the ErrorCode, null for an error without one)."""
    with open(path, "w") as out:
        for result in results:
            value = result.value
            if hasattr(value, "model_dump"):
                value = value.model_dump(mode="json")
            error = None
            if result.error is not None:
                error = {
                    "type": type(result.error).__name__,
                    "code": code_of(result.error),
                    "message": str(result.error),
                }
            line = {"index": result.index, "value": value, "error": error}
            out.write(json.dumps(line, default=str) + "\n")
