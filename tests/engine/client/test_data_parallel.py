"""Data parallelism (`data_parallel_size=2`): two engine-core processes behind one front end.
The router's rules on their own (load as waiting x 4 + running, prefix affinity that holds a
conversation but not a shared system prompt, spreading), then through real cores: a
session's turns stay on one replica and hit its prefix cache as with one replica, an abort
reaches the replica that owns the request, concurrent requests spread over both, stats are
summed and a prefix-cache reset reaches every replica."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt.engine.client.dp_router import DPRouter
from agentrt.engine.sampling_params import SamplingParams

BLOCK = 4


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_load_is_waiting_times_four_plus_running():
    router = DPRouter(2, BLOCK)
    assert router.route("a", _tokens(0, 10)) == 0  # a tie: the first replica
    assert router.load(0) == 4  # sent, not yet reported: counted as waiting
    router.report(0, num_waiting=2, num_running=3)
    assert router.load(0) == 2 * 4 + 3
    router.finished("a")
    assert router.load(0) == 0  # it owns nothing: idle whatever it last reported


def test_a_conversation_stays_on_its_replica_unless_that_is_much_more_loaded():
    router = DPRouter(2, BLOCK)
    prompt = _tokens(0, 20)
    replica = router.route("turn-1", prompt)
    router.report(replica, 0, 1)
    reply = _tokens(100, 8)
    router.finished("turn-1", prompt + reply)
    other = router.route("busy", _tokens(500, 20))  # something else, elsewhere
    assert other != replica
    router.route("more", _tokens(600, 20))  # the conversation's replica has one waiting...
    router.report(replica, 1, 0)
    router.report(other, 0, 1)
    next_turn = prompt + reply + _tokens(200, 6)
    assert router.route("turn-2", next_turn) == replica  # ...and keeps the conversation
    router.report(replica, 6, 1)  # far more loaded: the cache is not worth the wait
    assert router.route("turn-3", next_turn + _tokens(300, 4)) == other


def test_a_shared_system_prompt_does_not_pin_requests_to_one_replica():
    router = DPRouter(2, BLOCK)
    system = _tokens(0, 8)  # two full blocks every prompt starts with
    replicas = [router.route(f"r{i}", system + _tokens(1000 * (i + 1), 12)) for i in range(4)]
    assert sorted(replicas) == [0, 0, 1, 1]
    assert router.owners == {f"r{i}": replica for i, replica in enumerate(replicas)}


# -- two real core processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
async def dp_rt(tiny_model):
    async with agentrt.Runtime(
        tiny_model, dtype="float32", kv_cache_memory_gb=0.05, data_parallel_size=2
    ) as rt:
        yield rt


async def _run_sessions(rt: agentrt.Runtime) -> list[list]:
    """Two conversations (distinct system prompts) of three turns each, side by side; the
    usage of every turn."""
    usages: list[list] = [[], []]

    async def converse(i: int) -> None:
        session = rt.session(system=f"You are assistant number {i}. " * 6)
        for turn in range(3):
            await session.generate(f"Turn {turn}: say something.", max_tokens=12, ignore_eos=True)
            usages[i].append(session.last.usage)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(converse, i)
    return usages


@pytest.mark.anyio
async def test_session_turns_hit_the_cache_of_their_replica(dp_rt, tiny_model):
    before = await dp_rt.engine.replica_stats()
    usages = await _run_sessions(dp_rt)
    after = await dp_rt.engine.replica_stats()
    for turns in usages:
        for previous, turn in zip(turns, turns[1:], strict=False):
            # The previous turn's prompt is cached on the replica that served it.
            assert turn.cached_tokens >= previous.prompt_tokens // 16 * 16
    # The two conversations ran on different replicas.
    queried = [a.prefix_cache_queried_tokens - b.prefix_cache_queried_tokens for a, b in
               zip(after, before, strict=True)]  # fmt: skip
    assert all(q > 0 for q in queried)
    # The same conversations on one in-process engine hit the cache as often.
    async with agentrt.Runtime(tiny_model, dtype="float32", kv_cache_memory_gb=0.05) as one:
        reference = await _run_sessions(one)
    hits = sum(u.cached_tokens for turns in usages for u in turns)
    expected = sum(u.cached_tokens for turns in reference for u in turns)
    assert hits >= 0.9 * expected


async def _owners(engine, streams) -> list[int]:
    """The replica each request was routed to (routing happens on the client thread)."""
    owners = engine.client.router.owners
    with anyio.fail_after(5):
        while not all(s.request_id in owners for s in streams):
            await anyio.sleep(0.005)
    return [owners[s.request_id] for s in streams]


@pytest.mark.anyio
async def test_abort_reaches_the_owning_replica_and_load_spreads(dp_rt):
    engine = dp_rt.engine
    baseline = await engine.replica_stats()
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    streams = [engine.add_request(f"A long story number {i}:", long) for i in range(2)]
    owners = await _owners(engine, streams)
    assert sorted(owners) == [0, 1]  # two at once: one each
    with anyio.fail_after(30):
        while [s.num_running for s in await engine.replica_stats()] != [1, 1]:
            await anyio.sleep(0.02)
    await streams[0].aclose()  # abort the first
    with anyio.fail_after(10):
        while (await engine.replica_stats())[owners[0]].num_running:
            await anyio.sleep(0.02)
    stats = await engine.replica_stats()
    assert stats[owners[0]].kv_cache_usage == baseline[owners[0]].kv_cache_usage
    assert stats[owners[1]].num_running == 1  # the other one runs on
    summed = await engine.stats()
    assert summed.num_running == 1
    assert summed.prefix_cache_queried_tokens == sum(s.prefix_cache_queried_tokens for s in stats)
    await streams[1].aclose()

    # Eight independent requests at once land on both replicas and all finish.
    before = await engine.replica_stats()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    streams = [engine.add_request(f"Request {i} about topic {i * 7}", params) for i in range(8)]
    outs = [await s.result() for s in streams]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    after = await engine.replica_stats()
    prompt_tokens = [len(o.prompt_token_ids) for o in outs]
    queried = [_queried(a, b) for a, b in zip(after, before, strict=True)]
    assert sum(queried) == sum(prompt_tokens)
    assert min(queried) >= 3 * min(prompt_tokens)  # at least three requests each


def _queried(after, before) -> int:
    return after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens


@pytest.mark.anyio
async def test_reset_prefix_cache_reaches_every_replica(dp_rt):
    engine = dp_rt.engine
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompts = [f"Prompt {i} is long enough for three blocks of cache. " * 4 for i in range(2)]

    async def both() -> tuple[list[int], list[int]]:
        """The prompts at once (so one goes to each replica): cached tokens of each, and
        prefix-cache hits of each replica."""
        before = await engine.replica_stats()
        streams = [engine.add_request(p, params) for p in prompts]
        cached = [(await s.result()).num_cached_tokens for s in streams]
        after = await engine.replica_stats()
        hits = [a.prefix_cache_hit_tokens - b.prefix_cache_hit_tokens for a, b in
                zip(after, before, strict=True)]  # fmt: skip
        return cached, hits

    await both()
    cached, hits = await both()
    assert min(cached) >= 16 and min(hits) >= 16  # each replica served one from its cache
    await engine.reset_prefix_cache()
    cached, hits = await both()
    assert cached == [0, 0] and hits == [0, 0]
