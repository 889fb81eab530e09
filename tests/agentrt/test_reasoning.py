"""Reasoning before the schema in the SDK: the reasoning comes apart (Result.reasoning,
usage.reasoning_tokens, ReasoningText deltas), the schema constrains the answer only, the
budget forces the end, drafting changes nothing, and the history keeps its prefix hits."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import agentrt
from agentrt.engine.client.llm import LLM

pytestmark = pytest.mark.anyio


class Short(BaseModel):
    code: str = Field(max_length=6)
    ok: Literal[True]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


async def test_the_embedded_model_reasons_then_answers(rt):
    """SmolLM2 has no reasoning markers: named by reasoning_parser, forced by reasoning=True,
    they are text; the budget forces the end marker after 12 reasoning tokens."""
    session = rt.session(system="You extract facts as JSON.")
    person = await session.generate(
        "John Smith is 42.",
        schema=Person,
        reasoning=True,
        reasoning_parser="qwen3",
        max_reasoning_tokens=12,
    )
    assert isinstance(person, Person)
    last = session.last
    assert last.reasoning and "</think>" not in last.reasoning
    assert Person.model_validate_json(last.text) == person  # the answer alone
    raw = session.messages[-1]["content"]
    assert raw.startswith("<think>") and raw.endswith(last.text)
    tokenizer = rt.backend.engine.tokenizer
    markers = len(tokenizer.encode("<think>", add_special_tokens=False)) + len(
        tokenizer.encode("</think>", add_special_tokens=False)
    )
    assert last.usage.reasoning_tokens <= 12 + markers
    assert last.usage.completion_tokens > last.usage.reasoning_tokens


@pytest.fixture(scope="module")
def think_llm(tiny_think_checkpoint) -> LLM:
    return LLM(
        str(tiny_think_checkpoint), dtype="float32", kv_cache_memory_gb=0.02, grammar_timeout_s=120
    )


@pytest.fixture(scope="module")
def think_ids(think_llm) -> tuple[int, int]:
    return tuple(think_llm.engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))


async def test_a_qwen3_model_thinks_in_its_own_tokens(think_llm, think_ids):
    start_id, end_id = think_ids
    async with agentrt.Runtime(engine=think_llm.engine) as rt:
        session = rt.session()
        # "auto": the template leaves it to the model; a bias makes it open the block.
        value = await session.generate(
            "A code?", schema=Short, max_reasoning_tokens=8, logit_bias={start_id: 100.0}
        )
        last = session.last
        assert value.ok is True and last.reasoning is not None
        assert last.usage.reasoning_tokens == 1 + 8 + 1  # <think>, 8 tokens, </think>
        assert Short.model_validate_json(last.text) == value
        # reasoning=False: the template closes an empty block, the reply answers at once.
        await session.generate(
            "Again?", schema=Short, reasoning=False, logit_bias={start_id: 100.0}
        )
        assert session.last.reasoning is None and session.last.usage.reasoning_tokens == 0
        # OpenAI's reasoning_effort: "none" turns it off too, "low" on.
        await session.generate(
            "Once more?", schema=Short, reasoning_effort="none", logit_bias={start_id: 100.0}
        )
        assert session.last.reasoning is None
        await session.generate(
            "Think?", schema=Short, reasoning_effort="low", max_reasoning_tokens=2
        )
        assert session.last.reasoning is not None  # the template opened nothing: forced
        with pytest.raises(agentrt.InvalidRequestError, match="reasoning_effort"):
            await session.generate("Bad?", schema=Short, reasoning_effort="huge")
        # Streaming: the reasoning deltas first, apart, then the answer's partial values.
        items = [
            item
            async for item in session.stream(
                "Stream it.", schema=Short, max_reasoning_tokens=5, logit_bias={start_id: 100.0}
            )
        ]
    reasoning = [i for i in items if isinstance(i, agentrt.ReasoningText)]
    assert reasoning and "".join(reasoning) == session.last.reasoning
    assert items[-1] == Short.model_validate_json(session.last.text)
    assert all(isinstance(i, agentrt.ReasoningText) for i in items[: len(reasoning)])


@pytest.mark.slow
async def test_drafting_on_and_off_decode_the_same(tiny_think_checkpoint, think_ids):
    """Greedy fp32: drafts that cross the end marker (the forced `</think>`, then the
    answer's forced `{"code": "`) are masked per position like any other, so the reply is
    the same token for token as decoding one token a step without jump-forward."""
    start_id, _ = think_ids
    replies = []
    for options in (
        {"jump_forward": False},
        {"speculative_config": {"method": "grammar", "num_speculative_tokens": 4}},
    ):
        async with agentrt.Runtime(
            str(tiny_think_checkpoint),
            dtype="float32",
            kv_cache_memory_gb=0.02,
            grammar_timeout_s=120,  # a loaded machine: no false timeouts
            **options,
        ) as rt:
            session = rt.session()
            for prompt in ("A code? A code? A code?", "Once more: a code?"):
                await session.generate(
                    prompt,
                    schema=Short,
                    max_reasoning_tokens=24,
                    max_tokens=60,
                    logit_bias={start_id: 100.0},
                )
            replies.append([m["content"] for m in session.messages])
            stats = await rt.stats()
    assert replies[0] == replies[1]
    assert stats.spec_decode.num_accepted_tokens > 0  # drafts were verified, some accepted
    assert all("</think>" in reply for reply in replies[0][1::2])


async def test_a_multi_turn_reasoning_session_keeps_its_prefix_hits(think_llm, think_ids):
    start_id, _ = think_ids
    async with agentrt.Runtime(engine=think_llm.engine) as rt:
        session = rt.session(system="You answer with a code. " * 8)
        for turn in range(4):
            await session.generate(
                f"Code number {turn}?",
                schema=Short,
                max_reasoning_tokens=10,
                logit_bias={start_id: 100.0},
            )
            usage = session.last.usage
        # The last prompt holds three reasoning replies; all of them came from the cache.
        assert usage.cached_tokens / usage.prompt_tokens >= 0.8
        assert json.loads(session.last.text)["ok"] is True
