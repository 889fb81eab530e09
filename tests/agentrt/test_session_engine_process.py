"""The Session tests of test_session.py, run through a Runtime whose engine core is in its
own process (`Runtime(engine_process=True)`): prefix-cache hits across turns, forks,
streaming partial objects, typed schema errors, cancellation and early exits behave as
in-process."""

from __future__ import annotations

import pytest

import agentrt
from tests.agentrt import test_session as in_process

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def rt(smollm2_dir):
    async with agentrt.Runtime(dtype="float32", kv_cache_memory_gb=0.25, engine_process=True) as rt:
        assert rt.engine.engine is None  # the model lives in the core process
        yield rt


# Schema kinds are covered once at the engine level (tests/engine/test_engine_process.py:
# constrained output equal to the in-process engine's); compiling each grammar again in the
# core process would double the slowest SDK test.


@pytest.mark.slow
async def test_turns_hit_the_prefix_cache_and_history_grows(rt):
    await in_process.test_turns_hit_the_prefix_cache_and_history_grows(rt)


@pytest.mark.slow
async def test_fork_shares_the_prefix_and_diverges(rt):
    await in_process.test_fork_shares_the_prefix_and_diverges(rt)


@pytest.mark.slow
async def test_stream_partial_objects_are_prefixes_of_the_final_object(rt):
    await in_process.test_stream_partial_objects_are_prefixes_of_the_final_object(rt)


test_schema_errors_are_typed_and_name_the_problem = (
    in_process.test_schema_errors_are_typed_and_name_the_problem
)
test_cancelled_generate_frees_its_blocks = in_process.test_cancelled_generate_frees_its_blocks
test_leaving_a_stream_early_aborts_the_request = (
    in_process.test_leaving_a_stream_early_aborts_the_request
)
