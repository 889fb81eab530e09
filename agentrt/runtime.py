"""Runtime: owns where generation happens — a local engine (the embedded default model with no
arguments; on a thread of this process, or with `engine_process=True` / `data_parallel_size=N`
in engine-core processes of its own) or, with `base_url`, any OpenAI-compatible server — and
hands out Sessions, one-shot `generate`, `extract_many` and Agents on top of it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from agentrt.backend import Backend, LocalBackend
from agentrt.engine.args import EngineArgs
from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm_engine import LLMEngine
from agentrt.engine.errors import ConfigError
from agentrt.extract import Document, ExtractResult, extract_iter, extract_many
from agentrt.session import Session


class Runtime:
    """`async with agentrt.Runtime() as rt:` — options are the engine's (`dtype`,
    `max_num_seqs`, `kv_cache_memory_gb`, `engine_process`, `data_parallel_size`, ...: the
    fields of `agentrt.engine.EngineArgs`), checked here. `engine=` reuses an already loaded
    `LLMEngine`. With `base_url` (and
    `api_key`), the same API runs against a remote OpenAI-compatible server, `model` naming
    the served model."""

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        engine: LLMEngine | None = None,
        config: str | os.PathLike[str] | None = None,
        **engine_options: Any,
    ) -> None:
        """`config`: a JSON file of engine options (e.g. written by `agentrt tune`); options
        given here override it."""
        if config is not None:
            engine_options = {**EngineArgs.read_config_file(config), **engine_options}
            file_model = engine_options.pop("model", None)
            model = file_model if model is None else model
        self.model = model
        self.base_url = base_url
        self._api_key = api_key
        self._backend: Backend | None = None
        self.engine: AsyncEngine | None = None  # while running locally
        self._local: AsyncEngine | None = None
        if base_url is None:  # built (and its options checked) now; started on enter
            self._local = AsyncEngine(model, engine=engine, **engine_options)
        elif engine is not None or engine_options:
            raise ConfigError(
                f"engine options ({sorted(engine_options) or 'engine='}) apply to a local "
                "engine, not to a remote server (base_url): drop them or drop base_url."
            )

    async def __aenter__(self) -> Runtime:
        if self.base_url is not None:
            from agentrt.remote import RemoteBackend

            self._backend = RemoteBackend(
                base_url=self.base_url, api_key=self._api_key, model=self.model
            )
            return self
        self.engine = self._local
        await self.engine.__aenter__()
        self._backend = LocalBackend(self.engine)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None
        close = getattr(self._backend, "aclose", None)
        if close is not None:
            await close()
        self._backend = None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the Runtime is not running: use `async with Runtime(...) as rt:`.")
        return self._backend

    def session(self, system: str | None = None, **sampling: Any) -> Session:
        """A new conversation; `sampling` options apply to each of its turns."""
        return Session(self.backend, system=system, **sampling)

    async def generate(
        self, prompt: str, schema: Any = None, *, system: str | None = None, **options: Any
    ) -> Any:
        """One turn in a fresh session (see `Session.generate`)."""
        return await self.session(system).generate(prompt, schema, **options)

    async def extract_many(
        self,
        texts: Iterable[str | Document] | AsyncIterable[str | Document],
        schema: Any,
        *,
        instructions: str = "Extract the requested fields from the document as JSON.",
        concurrency: int = 32,
        progress: bool = True,
        **sampling: Any,
    ) -> list[ExtractResult]:
        """One result per text, in input order (see `agentrt.extract.extract_many`)."""
        return await extract_many(
            self.backend,
            texts,
            schema,
            instructions=instructions,
            concurrency=concurrency,
            progress=progress,
            **sampling,
        )

    def extract_iter(
        self,
        documents: Iterable[str | Document] | AsyncIterable[str | Document],
        schema: Any,
        *,
        instructions: str = "Extract the requested fields from the document as JSON.",
        concurrency: int = 32,
        **sampling: Any,
    ) -> AsyncIterator[ExtractResult]:
        """`async for result in rt.extract_iter(docs, schema)`: results as they finish, the
        documents read lazily (see `agentrt.extract.extract_iter`)."""
        return extract_iter(
            self.backend,
            documents,
            schema,
            instructions=instructions,
            concurrency=concurrency,
            **sampling,
        )

    async def stats(self) -> Any:
        return await self.backend.stats()
