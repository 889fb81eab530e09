"""Every SDK test that runs on a Runtime (`rt`) — sessions, agents, extraction — run again
through a Runtime whose engine core is in its own process (`Runtime(engine_process=True)`):
prefix-cache hits across turns, forks, streaming partial objects, typed schema errors,
cancellation, early exits, tool calls and batch extraction behave as in-process.

The tests are the in-process modules' own functions, collected here a second time with
this module's `rt` fixture: a test added there runs here too.
"""

from __future__ import annotations

import inspect

import pytest

import agentrt
from tests.agentrt import test_agent, test_extract, test_session

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def rt(smollm2_dir):
    # The engine as users run it (the GGUF's Q4_1 blocks), like the in-process `rt`.
    async with agentrt.Runtime(kv_cache_memory_gb=0.25, engine_process=True) as rt:
        assert rt.engine.engine is None  # the model lives in the core process
        yield rt


def _runtime_tests(module) -> dict:
    """The module's tests that take the `rt` fixture."""
    return {
        name: test
        for name, test in vars(module).items()
        if name.startswith("test_") and "rt" in inspect.signature(test).parameters
    }


for _module in (test_session, test_agent, test_extract):
    for _name, _test in _runtime_tests(_module).items():
        globals()[f"{_name}__{_module.__name__.rsplit('.', 1)[-1].removeprefix('test_')}"] = _test
