"""Signed thinking blocks of the Messages API, through a real `agentrt serve` on a tiny
random Qwen3 (its tokenizer has `<think>` / `</think>`; fp32, greedy) with the official
`anthropic` client: the whole and streamed blocks carry the same signature, a block sent
back unchanged is accepted, an altered or unsigned one is Anthropic's 400."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from agentrt.server.messages_thinking import ThinkingSigner
from tests.agentrt.server.helpers import ServerProcess

pytestmark = pytest.mark.slow  # a server process of its own

ASK = [{"role": "user", "content": "A code, please."}]


@pytest.fixture(scope="module")
def claude(tiny_think_checkpoint) -> Iterator[anthropic.Anthropic]:
    args = ("--model", str(tiny_think_checkpoint), "--dtype", "float32")
    with ServerProcess(*args, "--served-model-name", "think", "--kv-cache-memory-gb", "0.02") as s:
        yield anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)


def thinking_request(messages: list) -> dict:
    """A reply that thinks (effort "high": the grammar opens the block) for 6 tokens."""
    return dict(
        model="think",
        max_tokens=12,
        messages=messages,
        thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={"temperature": 0, "output_config": {"effort": "high"}},
    )


def think(claude: anthropic.Anthropic, messages: list):
    return claude.messages.create(**thinking_request(messages))


def test_thinking_is_signed_whole_and_streamed(claude: anthropic.Anthropic):
    message = think(claude, ASK)
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking
    assert thinking.signature  # was "" before
    with claude.messages.stream(**thinking_request(ASK)) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
    assert deltas[-1] == "signature_delta" and deltas.count("signature_delta") == 1
    assert streamed.content[0].model_dump() == thinking.model_dump()


def test_a_thinking_block_sent_back_must_verify(claude: anthropic.Anthropic):
    message = think(claude, ASK)
    thinking = message.content[0].model_dump()
    reply = [block.model_dump() for block in message.content]
    history = [*ASK, {"role": "assistant", "content": reply}]
    follow_up = {"role": "user", "content": "Another one."}
    assert think(claude, [*history, follow_up]).content  # unchanged: accepted

    for altered in (
        {**thinking, "thinking": thinking["thinking"] + " and more"},
        {**thinking, "signature": ""},
        {**thinking, "signature": ThinkingSigner.for_server(None, "think").sign("x")},
    ):
        sent = [*ASK, {"role": "assistant", "content": [altered, *reply[1:]]}, follow_up]
        with pytest.raises(anthropic.BadRequestError) as refused:
            think(claude, sent)
        error = refused.value.body["error"]
        assert error["type"] == "invalid_request_error"
        assert "Invalid `signature` in `thinking` block" in error["message"]


def test_instances_sharing_a_secret_verify_each_others_blocks():
    secret = "a-secret-shared-by-the-instances-0123"
    signature = ThinkingSigner.for_server(secret, "m").sign("because")
    assert ThinkingSigner.for_server(secret, "m").verifies("because", signature)
    assert not ThinkingSigner.for_server(secret, "other-model").verifies("because", signature)
    assert not ThinkingSigner.for_server(None, "m").verifies("because", signature)
    assert not ThinkingSigner.for_server(secret, "m").verifies("because", None)
