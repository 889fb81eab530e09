"""AsyncEngine with the engine core in its own process (`engine_process=True`): the same
outputs as the in-process engine (greedy, constrained, stop strings, logprobs), bad input
raising in the caller, cancellation freeing blocks in the core, utility calls by name, the
load error raised with its own type, a bounded queue, and a core killed with SIGKILL failing
every pending request with `EngineDeadError` at once."""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest
from pydantic import BaseModel

from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
)
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import stream_all

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
# Aborted at its first token: far longer than the 10 s `_wait_idle` allows (400 tokens of
# the default engine would end inside it).
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def process_engine(smollm2_dir):
    """The embedded model (the default engine, as `smollm2_default_llm`) in one engine process
    for the module."""
    async with AsyncEngine(None, kv_cache_memory_gb=0.25, engine_process=True) as engine:
        yield engine


async def _wait_idle(engine: AsyncEngine) -> None:
    with anyio.fail_after(10):
        while (await engine.stats()).num_running:
            await anyio.sleep(0.01)


@pytest.mark.slow
async def test_greedy_streams_match_the_in_process_engine(smollm2_default_llm: LLM, process_engine):
    assert process_engine.engine is None  # nothing of the model in this process
    expected = [o.outputs[0].text for o in smollm2_default_llm.generate(PROMPTS, GREEDY)]
    texts, finals = await stream_all(process_engine, PROMPTS, GREEDY)
    assert texts == expected
    assert [f.outputs[0].text for f in finals] == expected
    assert all(f.outputs[0].finish_reason == "length" for f in finals)


@pytest.mark.slow
async def test_constrained_output_stop_strings_and_logprobs_match(
    smollm2_default_llm: LLM, process_engine
):
    constrained = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=City)
    )
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"])
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    cases = [
        ("Describe Paris as JSON.", constrained),
        ("Write three lines about the sea.\n", stopped),
        ("The capital of France is", with_logprobs),
    ]
    for prompt, params in cases:
        expected = smollm2_default_llm.generate([prompt], params)[0].outputs[0]
        got = (await process_engine.generate(prompt, params)).outputs[0]
        assert got.text == expected.text
        assert got.token_ids == expected.token_ids
        assert (got.finish_reason, got.stop_reason) == (
            expected.finish_reason,
            expected.stop_reason,
        )
        if params is constrained:
            City.model_validate_json(got.text)
            assert got.structured_errors == []
        if params is with_logprobs:
            assert len(got.logprobs) == len(expected.logprobs) == 8
            for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
                assert mine.keys() == theirs.keys()
                for token_id in mine:
                    assert mine[token_id].logprob == pytest.approx(theirs[token_id].logprob)
                    assert mine[token_id].decoded_token == theirs[token_id].decoded_token


async def test_bad_input_raises_in_the_caller(process_engine):
    with pytest.raises(InvalidRequestError) as info:
        process_engine.add_request("x", SamplingParams(max_tokens=10**7))
    assert info.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError):
        process_engine.add_request([10**9], GREEDY)  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        process_engine.add_request(messages=[], params=GREEDY)
    assert process_engine.num_pending_requests == 0
    out = await process_engine.generate(messages=[{"role": "user", "content": "Hi"}], params=GREEDY)
    assert out.outputs[0].finish_reason == "length"


async def test_cancelling_the_caller_aborts_and_frees_blocks_in_the_core(process_engine):
    baseline = (await process_engine.stats()).kv_cache_usage
    got_tokens = anyio.Event()

    async def consume() -> None:
        async for delta in process_engine.add_request("Count to a thousand:", LONG):
            if delta.token_ids:
                got_tokens.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await got_tokens.wait()
        stats = await process_engine.stats()
        assert stats.num_running == 1 and stats.kv_cache_usage > baseline
        tg.cancel_scope.cancel()
    await _wait_idle(process_engine)
    assert (await process_engine.stats()).kv_cache_usage == baseline
    assert process_engine.num_pending_requests == 0
    # Closing a stream early aborts too.
    async with process_engine.add_request("Count to a thousand:", LONG) as stream:
        async for delta in stream:
            if delta.token_ids:
                break
    await _wait_idle(process_engine)
    assert (await process_engine.stats()).kv_cache_usage == baseline


async def test_utility_calls_go_by_name(process_engine):
    prompt = "A prompt long enough to fill two blocks of the prefix cache, " * 3
    params = SamplingParams(temperature=0.0, max_tokens=2)
    await process_engine.generate(prompt, params)
    again = await process_engine.generate(prompt, params)
    assert again.num_cached_tokens >= 32
    await process_engine.reset_prefix_cache()
    after_reset = await process_engine.generate(prompt, params)
    assert after_reset.num_cached_tokens == 0
    stats = await process_engine.stats()
    assert stats.prefix_cache_hit_tokens >= again.num_cached_tokens
    assert await process_engine.replica_stats() == [stats]
    with pytest.raises(ConfigError, match="in-process engine"):
        await process_engine.call(lambda engine: engine.kv_manager.check_invariants())


async def test_a_load_error_is_raised_with_its_own_type(tmp_path):
    engine = AsyncEngine(str(tmp_path / "no-such-model"), engine_process=True)
    with pytest.raises(ModelLoadError, match="no-such-model"):
        async with engine:
            pass
    assert all(p.exitcode is not None for p in engine.client.processes)


async def test_the_queue_is_bounded(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    async with AsyncEngine(
        path,
        dtype="float32",
        kv_cache_memory_gb=0.01,
        max_num_seqs=2,
        max_waiting_requests=0,
        engine_process=True,
    ) as engine:
        streams = [engine.add_request(f"Item {i}:", params) for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="retry later"):
            engine.add_request("one too many", params)
        outs = [await s.result() for s in streams]
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
        await engine.generate("room again", params)


async def test_a_killed_core_fails_every_pending_request(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    engine = AsyncEngine(path, dtype="float32", kv_cache_memory_gb=0.05, engine_process=True)
    async with engine:
        streams = [engine.add_request(f"prompt {i}", params) for i in range(3)]
        async for delta in streams[0]:
            if delta.token_ids:
                break
        os.kill(engine.client.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with anyio.fail_after(5):
            for stream in streams:
                with pytest.raises(EngineDeadError, match="died"):
                    await stream.result()
        assert time.monotonic() - started < 5
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.add_request("after death", params)
        with pytest.raises(EngineDeadError):
            await engine.stats()
    assert not engine.client.thread.is_alive()
