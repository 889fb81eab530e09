"""Extraction on a Ray cluster (the `ray` extra: `pip install 'agentrt[ray]'`).

`Extractor` is a callable class for `ray.data.Dataset.map_batches`, as vLLM's `ray.data.llm`
processors are: Ray Data starts one per actor, each owns one agentrt `Runtime` (one engine:
the model, the schema's grammar, the instructions), started on the actor's first batch and
kept for every batch after, so the shared instruction stays in that engine's prefix cache.

    ds = ray.data.read_parquet("docs.parquet")
    out = ds.map_batches(
        Extractor,
        fn_constructor_kwargs={"schema": Invoice, "instructions": "...", "model": "..."},
        concurrency=8,            # actors = engines
        batch_size=16,
    )
    out.write_parquet("results/")

Each output batch has the input's columns but the text, then `value` (the validated value
as JSON text, null on failure), `error_type`, `error_code`, `error_message` (null on
success), and `prompt_tokens`, `cached_tokens`, `completion_tokens`, `num_steered_tokens`.
A document's failure is a row with an error, never a failed batch. Ray Data restarts a dead
actor and runs its unfinished batches again (map_batches' defaults: max_restarts=-1,
max_task_retries=-1); a batch's rows are emitted only when the whole batch is done, so a
retried batch yields each row once.

`run_on_ray` is `agentrt extract --ray ADDRESS`: the driver reads the input lazily (same
ids, resume and bad-row rules as a local run) and streams it in batches to `num_actors`
Ray actors, each holding one Extractor (so one engine) for the whole job: their prefix
caches keep the instruction from the first batch to the last. An actor holds at most
BATCHES_PER_ACTOR batches at once, so the driver's memory is bounded by
`num_actors x BATCHES_PER_ACTOR x batch_size` documents, not by the input. The actors are
started with `max_restarts=-1` and `max_task_retries=-1`, as Ray Data's are: a dead actor is
started again (a new engine) and its unfinished batches run there; a batch's results come
back only when the whole batch is done, so each document's result is written once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agentrt.engine.errors import ErrorCode
from agentrt.errors import AgentrtError, code_of
from agentrt.extract import Document, ExtractResult, extract_iter
from agentrt.formats import resolve_format

RESULT_COLUMNS = ("value", "error_type", "error_code", "error_message")
USAGE_COLUMNS = ("prompt_tokens", "cached_tokens", "completion_tokens", "num_steered_tokens")
# Batches `run_on_ray` keeps on one actor at once: one running while the next waits there,
# so an actor never idles for the driver's round trip (the two run on one engine together).
BATCHES_PER_ACTOR = 2


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("agentrt.ray needs Ray Data: pip install 'agentrt[ray]'") from None
    return ray


class Extractor:
    """`ds.map_batches(Extractor, fn_constructor_kwargs={...}, concurrency=N)`: one engine
    per actor. `schema`: a Pydantic model, type or JSON-schema dict; `model`: as
    `Runtime(model)` (None: the embedded model); `engine_options`: `EngineArgs` fields;
    `sampling`: options of each request (max_tokens, temperature, ...). `text_column` holds
    the documents; every other input column is passed through."""

    def __init__(
        self,
        schema: Any,
        *,
        instructions: str = "Extract the requested fields from the document as JSON.",
        model: str | None = None,
        text_column: str = "text",
        engine_options: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        resolve_format(schema)  # a bad schema fails the actor's start, not every batch
        self.schema = schema
        self.instructions = instructions
        self.model = model
        self.text_column = text_column
        self.engine_options = dict(engine_options or {})
        self.sampling = dict(sampling or {})
        self._runtime = None
        self._starting: asyncio.Lock | None = None

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        """One batch (column -> array) in, the same rows with result columns out."""
        runtime = await self._started()
        texts = [_plain(text) for text in batch[self.text_column]]
        documents = [Document(i, text) for i, text in enumerate(texts)]
        results: list[ExtractResult | None] = [None] * len(documents)
        async for result in extract_iter(
            runtime.backend,
            documents,
            self.schema,
            instructions=self.instructions,
            concurrency=max(1, len(documents)),
            **self.sampling,
        ):
            results[result.index] = result
        out = {
            name: [_plain(item) for item in column]
            for name, column in batch.items()
            if name != self.text_column
        }
        columns = [result_columns(result) for result in results]
        for name in (*RESULT_COLUMNS, *USAGE_COLUMNS):
            out[name] = [row[name] for row in columns]
        return out

    async def _started(self):
        """The actor's Runtime, started by its first batch on the actor's event loop (Ray
        runs every batch of an async callable on that one loop)."""
        if self._runtime is not None:
            return self._runtime
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._runtime is None:
                from agentrt.runtime import Runtime

                runtime = Runtime(self.model, **self.engine_options)
                await runtime.__aenter__()
                self._runtime = runtime
        return self._runtime


def result_columns(result: ExtractResult) -> dict[str, Any]:
    """The result columns of one row (see the module docstring)."""
    value = result.value
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    error, usage = result.error, result.usage
    code = None if error is None else code_of(error)
    return {
        "value": None if error is not None else json.dumps(value),
        "error_type": None if error is None else getattr(error, "type_name", type(error).__name__),
        "error_code": None if code is None else str(code),
        "error_message": None if error is None else str(error),
        "prompt_tokens": 0 if usage is None else usage.prompt_tokens,
        "cached_tokens": 0 if usage is None else usage.cached_tokens,
        "completion_tokens": 0 if usage is None else usage.completion_tokens,
        "num_steered_tokens": result.num_steered_tokens,
    }


class ExtractError(AgentrtError):
    """A document's failure as an actor reported it: the original error's type name and
    code, and its message."""

    def __init__(self, message: str, *, type_name: str, code: ErrorCode | None) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.code = code if code is not None else ErrorCode.INTERNAL


def result_from_row(index: int, doc_id: str | int, row: dict[str, Any]) -> ExtractResult:
    """An `ExtractResult` back from the result columns of one output row."""
    from agentrt.backend import Usage

    result = ExtractResult(index, id=doc_id)
    if row["error_type"] is None:
        result.value = json.loads(row["value"])
    else:
        code = row["error_code"]
        result.error = ExtractError(
            row["error_message"],
            type_name=row["error_type"],
            code=None if code is None else ErrorCode(code),
        )
    result.usage = Usage(row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"])
    result.num_steered_tokens = row["num_steered_tokens"]
    return result


def connect(address: str):
    """`ray`, connected: "local" starts a cluster in this process, "auto" or host:port joins
    one; a process already connected stays so. Call it from the main thread."""
    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, logging_level="ERROR")
    return ray


def run_on_ray(
    job,
    schema: Any,
    instructions: str,
    pending: Iterator[Document],
    on_result: Callable[[ExtractResult], None],
    stop,
    *,
    extractor: Callable[..., Any] = Extractor,
) -> None:
    """`agentrt extract --ray`: the job's pending documents through `job.num_actors`
    actors, each holding one `extractor(**options)` (an Extractor; tests pass one that dies)
    for the whole job. `job.ray_address`: "local" starts a cluster in this process, "auto"
    or host:port joins one. Returns when the input is done or `stop` is set (the batches in
    flight then have no result; a resume runs them again). The actors end with it."""
    ray = connect(job.ray_address)
    engine_options = dict(job.engine_options)
    model = engine_options.pop("model", None)
    options = {
        "schema": schema,
        "instructions": instructions,
        "model": model,
        "engine_options": engine_options,
        "sampling": dict(job.sampling),
    }
    actor_class = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1)(_ExtractorActor)
    actors = [actor_class.remote(extractor, options) for _ in range(job.num_actors)]
    # ref -> (its actor, its documents); in flight until the actor's whole batch is back.
    in_flight: dict[Any, tuple[int, list[_Sent]]] = {}
    load = [0] * len(actors)  # batches in flight per actor
    batches = _batches(pending, on_result, job.batch_size)
    try:
        while not stop.is_set():
            while len(in_flight) < len(actors) * BATCHES_PER_ACTOR:
                documents = next(batches, None)
                if documents is None:
                    break
                actor = min(range(len(actors)), key=load.__getitem__)
                batch = {"row": list(range(len(documents))), "text": [d.text for d in documents]}
                in_flight[actors[actor].extract.remote(batch)] = actor, documents
                load[actor] += 1
            if not in_flight:
                return
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            actor, documents = in_flight.pop(ref)
            load[actor] -= 1
            out = ray.get(ref)
            rows = [
                dict(zip(out, values, strict=True)) for values in zip(*out.values(), strict=True)
            ]
            for row in rows:
                document = documents[row["row"]]
                on_result(result_from_row(document.index, document.id, row))
    finally:
        for actor in actors:
            ray.kill(actor)


class _ExtractorActor:
    """The Ray actor around one extractor: async, so Ray runs its batches on one event loop
    (the one the extractor's Runtime lives on), the waiting batch beside the running one."""

    def __init__(self, extractor: Callable[..., Any], options: dict[str, Any]) -> None:
        self.extractor = extractor(**options)

    async def extract(self, batch: dict[str, list]) -> dict[str, list]:
        return await self.extractor(batch)


def _batches(pending: Iterator[Document], on_result, batch_size: int) -> Iterator[list[_Sent]]:
    """The documents to send, `batch_size` at a time, each numbered in the order sent; rows
    that could not be read are written at once."""
    batch: list[_Sent] = []
    num_sent = 0
    for document in pending:
        if document.error is not None:
            on_result(ExtractResult(-1, id=document.id, error=document.error))
            continue
        batch.append(_Sent(num_sent, document.id, document.text))
        num_sent += 1
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True, slots=True)
class _Sent:
    """A document sent to an actor: its number in the order sent, its id and text."""

    index: int
    id: str | int
    text: str


def _plain(item: Any) -> Any:
    """A numpy scalar as the Python value (Ray hands batches over as numpy arrays)."""
    return item.item() if hasattr(item, "item") else item
