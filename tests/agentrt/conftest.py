"""SDK fixtures: a Runtime over the session's default engine on the embedded model (the
GGUF's own Q4_1 blocks, as users run it; shared with the engine tests, so it loads once),
under asyncio by default. The SDK's asserts are behaviour and validity, not fp32 equality:
on it test_session, test_agent and test_extract took 127 -> 63 s (one thread)."""

from __future__ import annotations

import pytest

import agentrt


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def rt(smollm2_default_llm):
    async with agentrt.Runtime(engine=smollm2_default_llm.engine) as runtime:
        yield runtime
