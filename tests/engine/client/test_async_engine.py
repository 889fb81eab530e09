"""AsyncEngine on the embedded model (the default engine: the GGUF's own Q4_1 blocks): streams
equal the synchronous engine's outputs, under asyncio and trio; cancellation frees blocks; a
fault fails every pending request; the waiting queue is bounded."""

from __future__ import annotations

import anyio
import pytest

from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
)
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.conftest import stream_all

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def _baseline_usage(engine: AsyncEngine) -> float:
    stats = await engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    return stats.kv_cache_usage


async def test_streams_match_the_sync_engine(smollm2_default_llm: LLM):
    expected = [o.outputs[0].text for o in smollm2_default_llm.generate(PROMPTS, GREEDY)]
    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        texts, finals = await stream_all(engine, PROMPTS, GREEDY)
        assert texts == expected
        assert [f.outputs[0].text for f in finals] == expected
        assert all(f.outputs[0].finish_reason == "length" for f in finals)
        await engine.call(lambda e: e.kv_manager.check_invariants())


async def test_chat_messages_and_bad_input_raise_in_the_caller(smollm2_default_llm: LLM):
    messages = [{"role": "user", "content": "Say hi."}]
    expected = smollm2_default_llm.chat(messages, GREEDY)[0].outputs[0].text
    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        out = await engine.generate(messages=messages, params=GREEDY)
        assert out.outputs[0].text == expected
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("x", SamplingParams(max_tokens=10**7))
        assert info.value.field == "max_tokens"
        with pytest.raises(InvalidRequestError):
            engine.add_request("x", messages=messages)
        # The engine still serves the next request.
        out = await engine.generate(messages=messages, params=GREEDY)
        assert out.outputs[0].text == expected


async def test_cancelling_the_caller_aborts_and_frees_blocks(smollm2_default_llm: LLM):
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        baseline = await _baseline_usage(engine)
        got_tokens = anyio.Event()

        async def consume() -> None:
            async for delta in engine.add_request("Count to a thousand:", long):
                if delta.token_ids:
                    got_tokens.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await got_tokens.wait()
            stats = await engine.stats()
            assert stats.num_running == 1 and stats.kv_cache_usage > baseline
            tg.cancel_scope.cancel()
        # The abort is applied between steps; the engine is idle again soon after.
        with anyio.fail_after(10):
            while (await engine.stats()).num_running:
                await anyio.sleep(0.01)
        assert await _baseline_usage(engine) == baseline
        assert engine.num_pending_requests == 0
        await engine.call(lambda e: e.kv_manager.check_invariants())


async def test_closing_a_stream_early_aborts_it(smollm2_default_llm: LLM):
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        baseline = await _baseline_usage(engine)
        async with engine.add_request("Count to a thousand:", long) as stream:
            async for delta in stream:
                if delta.token_ids:
                    break
        with anyio.fail_after(10):
            while (await engine.stats()).num_running:
                await anyio.sleep(0.01)
        assert await _baseline_usage(engine) == baseline


async def test_waiting_queue_is_bounded(smollm2_default_llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    async with AsyncEngine(engine=smollm2_default_llm.engine, max_waiting_requests=0) as engine:
        limit = smollm2_default_llm.engine.scheduler_config.max_num_seqs
        streams = [engine.add_request(f"Item {i}:", params) for i in range(limit)]
        with pytest.raises(EngineOverloadedError, match="retry later"):
            engine.add_request("one too many", params)
        outs = [await s.result() for s in streams]
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
        await engine.generate("room again", params)  # admitted once others finished


async def test_engine_fault_fails_every_pending_request(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.01)
    calls = 0
    original_step = llm.engine.engine_core.step

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault")
        return original_step()

    llm.engine.engine_core.step = failing_step
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    async with AsyncEngine(engine=llm.engine) as engine:
        streams = [engine.add_request(f"prompt {i}", params) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="injected fault"):
                await stream.result()
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.add_request("after death", params)
        with pytest.raises(EngineDeadError):
            await engine.stats()


async def test_shutdown_fails_open_streams_instead_of_hanging(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with AsyncEngine(engine=llm.engine) as engine:
        stream = engine.add_request("a prompt", params)
    with pytest.raises(EngineDeadError, match="shut down"):
        await stream.result()
    llm.engine.kv_manager.check_invariants()
    assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.kv_manager.num_blocks


async def test_a_request_that_fails_inside_the_engine_fails_alone(smollm2_default_llm: LLM):
    from agentrt.engine.errors import EngineError

    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        original = engine.engine.engine_core.add_request

        def refuse_one(request):
            if request.req_id == "poison":
                raise RuntimeError("cannot take this one")
            return original(request)

        engine.engine.engine_core.add_request = refuse_one
        try:
            with pytest.raises(EngineError, match="cannot take this one"):
                await engine.generate("x", GREEDY, request_id="poison")
            out = await engine.generate(PROMPTS[0], GREEDY)
        finally:
            del engine.engine.engine_core.add_request
        assert out.outputs[0].finish_reason == "length" and not engine.is_dead
        await engine.call(lambda e: e.kv_manager.check_invariants())


async def test_the_model_is_built_on_the_engine_thread(tiny_checkpoint, monkeypatch):
    """torch's OpenMP runtime keeps a worker team per thread that ran parallel work; a second
    team (from building on another thread) throttles spin-waiting and slows every step."""
    import threading

    from agentrt.engine.client import core_client

    built_on = []
    real = core_client.LLMEngine

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(core_client, "LLMEngine", recording)
    path = str(tiny_checkpoint("llama"))
    async with AsyncEngine(path, dtype="float32", kv_cache_memory_gb=0.01) as engine:
        assert await engine.call(lambda _: threading.current_thread().name) == "agentrt-engine"
    assert built_on == ["agentrt-engine"]


async def test_a_model_that_fails_to_load_raises_and_stops_the_thread(tmp_path):
    engine = AsyncEngine(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="no-such-model"):
        async with engine:
            pass
    assert not engine.client.thread.is_alive()
