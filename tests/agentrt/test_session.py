"""Sessions on the embedded model: every schema kind round-trips into its Python value,
turns hit the prefix cache, streaming yields growing valid partials, forks share the prefix,
and every failure is a typed error."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal

import anyio
import pytest
from pydantic import BaseModel, Field, field_validator

import agentrt
from agentrt import (
    Choice,
    EngineDeadError,
    OutputValidationError,
    Regex,
    SchemaError,
    TruncatedOutputError,
)

pytestmark = pytest.mark.anyio


class Color(enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=130)


SYSTEM = "You are a precise assistant that answers in JSON when asked."


async def _at_once(**calls) -> dict:
    """Await independent requests at once (they share the engine's batches): their values."""
    values = {}

    async def one(name, call) -> None:
        values[name] = await call

    async with anyio.create_task_group() as tg:
        for name, call in calls.items():
            tg.start_soon(one, name, call)
    return values


async def test_schema_kinds_round_trip(rt):
    session = rt.session(system=SYSTEM)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 3}},
        "required": ["ok", "n"],
    }
    # Nine independent requests in one batch: the time of the longest, not of all nine.
    v = await _at_once(
        city=session.generate("Describe Paris as JSON.", schema=City),
        people=rt.generate(
            "List two people as JSON.", schema=Annotated[list[Person], Field(max_length=3)]
        ),
        answer=rt.generate("Is the sky blue? yes or no", schema=Literal["yes", "no"]),
        color=rt.generate("Pick a color.", schema=Color),
        either=rt.generate("A number or a word.", schema=int | str),
        value=rt.generate("Give ok and n.", schema=schema),
        code=rt.generate("A product code.", schema=Regex(r"[A-Z]{2}-[0-9]{3}")),
        pick=rt.generate("Pick a fruit.", schema=Choice(["apple", "pear"])),
        text=rt.generate("Say hello.", max_tokens=8),
    )
    assert isinstance(v["city"], City)
    people = v["people"]
    assert isinstance(people, list) and all(isinstance(p, Person) for p in people)
    assert v["answer"] in ("yes", "no")
    assert isinstance(v["color"], Color)
    assert isinstance(v["either"], int | str)
    assert isinstance(v["value"]["ok"], bool) and v["value"]["n"] >= 3
    code = v["code"]
    assert len(code) == 6 and code[2] == "-" and code[3:].isdigit()
    assert v["pick"] in ("apple", "pear")
    assert isinstance(v["text"], str) and v["text"]


async def test_turns_hit_the_prefix_cache_and_history_grows(rt):
    session = rt.session(system=SYSTEM + " " + "Be brief. " * 20)
    await session.generate("Name a city.", max_tokens=12)
    first = session.last.usage
    await session.generate("Name another one.", max_tokens=12)
    second = session.last.usage
    await session.generate("And a third.", max_tokens=12)
    third = session.last.usage
    assert [m["role"] for m in session.history] == ["system"] + ["user", "assistant"] * 3
    # Turn N re-sends turn N-1's prompt and reply: all of it but the last partial block
    # (16 tokens) and the reply's last token is served from the cache.
    assert second.cached_tokens >= first.prompt_tokens + first.completion_tokens - 16 - 1 - 8
    assert third.cached_tokens >= second.prompt_tokens + second.completion_tokens - 16 - 1 - 8
    assert session.usage.prompt_tokens == sum(u.prompt_tokens for u in (first, second, third))


async def test_fork_shares_the_prefix_and_diverges(rt):
    session = rt.session(system=SYSTEM + " Topic: travel. " * 10)
    await session.generate("Name a country.", max_tokens=10)
    branch = session.fork()
    await branch.generate("Name its capital.", max_tokens=10)
    await session.generate("Name a river.", max_tokens=10)
    assert branch.last.usage.cached_tokens >= 32
    assert branch.history[:3] == session.history[:3]
    assert branch.history[3]["content"] == "Name its capital."
    assert session.history[3]["content"] == "Name a river."


async def test_stream_text_deltas_concatenate_to_the_reply(rt):
    session = rt.session()
    deltas = [d async for d in session.stream("Count from one to five.", max_tokens=20)]
    assert all(isinstance(d, str) for d in deltas) and len(deltas) > 1
    assert "".join(deltas) == session.last.text
    assert session.history[-1] == {"role": "assistant", "content": session.last.text}


async def test_stream_partial_objects_are_prefixes_of_the_final_object(rt):
    session = rt.session(system=SYSTEM)
    items = [p async for p in session.stream("Describe Tokyo as JSON.", schema=City)]
    final = items[-1]
    assert isinstance(final, City) and final == session.last.value
    partials = items[:-1]
    assert partials, "fields should appear one by one"
    sizes = [len(p.model_fields_set) for p in partials]
    assert sizes == sorted(sizes) and sizes[-1] <= 3
    for partial in partials:
        for name in partial.model_fields_set:  # every field shown is already final
            assert getattr(partial, name) == getattr(final, name)


async def test_truncated_output_carries_the_partial_text(rt):
    with pytest.raises(TruncatedOutputError) as info:
        await rt.generate("Describe Rome as JSON.", schema=City, max_tokens=5)
    assert info.value.usage.completion_tokens == 5
    whole = rt.session()
    await whole.generate("Describe Rome as JSON.", schema=City)
    # greedy: the partial text is where the whole answer starts, 5 tokens of it
    assert len(info.value.text) > 1 and whole.last.text.startswith(info.value.text)
    session = rt.session()
    with pytest.raises(TruncatedOutputError):
        await session.generate("Describe Rome.", schema=City, max_tokens=5)
    assert session.history == []  # a failed turn does not join the history


async def test_schema_errors_are_typed_and_name_the_problem(rt):
    with pytest.raises(SchemaError, match="not a schema"):
        await rt.generate("x", schema=5)
    with pytest.raises(SchemaError, match="invalid"):
        await rt.generate("x", schema={"type": "no-such-type"})
    with pytest.raises(SchemaError, match="missing"):
        await rt.generate("x", schema={"properties": {"a": {"$ref": "#/$defs/missing"}}})
    with pytest.raises(agentrt.InvalidRequestError, match="unknown sampling options"):
        await rt.generate("x", temprature=0.5)
    # The engine serves the next request.
    assert await rt.generate("Say yes or no.", schema=Choice(["yes", "no"])) in ("yes", "no")


async def test_post_validation_failure_and_explicit_retries(rt):
    seen: list[str] = []

    class Checked(BaseModel):
        name: str = Field(max_length=20)

        @field_validator("name")
        @classmethod
        def second_answer_only(cls, value: str) -> str:
            seen.append(value)
            if len(seen) % 2:
                raise ValueError("not accepted on the first try")
            return value

    with pytest.raises(OutputValidationError) as info:
        await rt.generate("A name as JSON.", schema=Checked)
    assert "not accepted" in str(info.value) and info.value.errors
    assert json.loads(info.value.text) == {"name": seen[0]}  # the answer the validator saw
    first_attempt = info.value.usage
    seen.clear()
    session = rt.session()
    value = await session.generate("A name as JSON.", schema=Checked, retries=1)
    assert isinstance(value, Checked) and len(seen) == 2
    # The usage covers both attempts; the retry re-sent the first attempt and the errors.
    assert session.last.usage.prompt_tokens > 2 * first_attempt.prompt_tokens
    assert [m["role"] for m in session.history] == ["user", "assistant"]


# A reply far longer than the 10 s the tests give a cancelled one to free its blocks (400
# tokens took 6 s on the default engine; 2,000 take over a minute).
ENDLESS = {"max_tokens": 2000, "ignore_eos": True}


async def test_cancelled_generate_frees_its_blocks(rt):
    baseline = await rt.stats()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: rt.generate("Write a very long story.", **ENDLESS))
        with anyio.fail_after(30):
            while (await rt.stats()).num_running == 0:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    with anyio.fail_after(10):
        while (await rt.stats()).num_running:
            await anyio.sleep(0.01)
    after = await rt.stats()
    assert after.kv_cache_usage == baseline.kv_cache_usage
    assert after.num_waiting == 0


@pytest.mark.slow
async def test_64_concurrent_generates_are_all_valid(rt):
    results: list[Person | None] = [None] * 64

    async def one(i: int) -> None:
        results[i] = await rt.generate(f"Invent person number {i} as JSON.", schema=Person)

    async with anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)
    assert all(isinstance(p, Person) and 0 <= p.age <= 130 for p in results)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_runs_under_asyncio_and_trio(smollm2_default_llm, anyio_backend):
    async with agentrt.Runtime(engine=smollm2_default_llm.engine) as rt:
        person = await rt.session(system=SYSTEM).generate("Ann is 30. As JSON.", schema=Person)
        assert isinstance(person, Person)
        deltas = [d async for d in rt.session().stream("Hi!", max_tokens=6)]
        assert deltas


async def test_engine_fault_raises_engine_dead_error(tiny_checkpoint):
    from agentrt.engine.client.llm import LLM

    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.01)

    def broken_step():
        raise RuntimeError("injected fault")

    llm.engine.engine_core.step = broken_step
    async with agentrt.Runtime(engine=llm.engine) as rt:
        with pytest.raises(EngineDeadError, match="injected fault"):
            await rt.generate("hello", max_tokens=4)
        with pytest.raises(EngineDeadError):
            await rt.session().generate("again", max_tokens=4)


async def test_leaving_a_stream_early_aborts_the_request(rt):
    baseline = await rt.stats()
    session = rt.session()
    async for _ in session.stream("Write a very long story.", **ENDLESS):
        break  # the generator is finalized when dropped; that closes the engine stream
    with anyio.fail_after(10):
        while (await rt.stats()).num_running:
            await anyio.sleep(0.01)
    assert (await rt.stats()).kv_cache_usage == baseline.kv_cache_usage
    assert session.history == []


async def test_a_reply_closed_early_by_the_budget_says_so(rt, caplog):
    class Story(BaseModel):
        story: str

    session = rt.session()
    value = await session.generate(
        "Write a very long story about the sea, as JSON.", Story, max_tokens=40
    )
    assert isinstance(value, Story) and value.story
    assert session.last.finish_reason == "stop" and session.last.num_steered_tokens > 0
    assert "steered to close it" in caplog.text
    # A reply that ends by itself, far from its budget (~157 tokens of 512), is not steered.
    await session.generate("Is water wet? Answer in JSON, the story being one word.", Story)
    assert session.last.finish_reason == "stop" and session.last.num_steered_tokens == 0


async def test_runtime_takes_a_speculative_config():
    """`Runtime(speculative_config=...)` as on `LLM`: the same validated object as without
    drafting (greedy; grammar drafts replace jump-forward, so the reference runs without
    it), and the drafts show in the stats."""
    question = "Ada Lovelace was 36. Give her as JSON."
    async with agentrt.Runtime(dtype="float32", jump_forward=False) as plain:
        want = await plain.session(system=SYSTEM).generate(question, schema=Person, temperature=0)
    config = {"method": "grammar"}
    async with agentrt.Runtime(dtype="float32", speculative_config=config) as drafting:
        got = await drafting.session(system=SYSTEM).generate(question, schema=Person, temperature=0)
        stats = await drafting.stats()
    assert got == want
    assert stats.spec_decode_method == "grammar" and stats.spec_decode.num_accepted_tokens > 0
