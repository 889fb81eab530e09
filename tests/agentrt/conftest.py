"""SDK fixtures: a Runtime over the session's embedded-model engine (shared with the engine
tests, so the model loads once), under asyncio by default."""

from __future__ import annotations

import pytest

import agentrt


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def rt(smollm2_llm):
    async with agentrt.Runtime(engine=smollm2_llm.engine) as runtime:
        yield runtime
