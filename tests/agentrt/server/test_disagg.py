"""Disaggregated prefill/decode end to end: a producer (`agentrt serve --kv-connector p2p
--kv-role producer`), a consumer (`--kv-role consumer`) and `agentrt proxy` in front, all real
processes on localhost, driven by the official `openai` client. Greedy answers must equal
one instance's (the session's `server`, the same default engine), the consumer must have
loaded the prefill instead of computing it, and a dead producer must only cost the consumer
its own prefill."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.agentrt.server.helpers import API_KEY, ServerProcess, metrics

INSTANCE = (
    *("--kv-cache-memory-gb", "0.1", "--kv-connector", "p2p"),
    *("--kv-secret", "the-instances-shared-secret"),
)
SYSTEM = "You are a careful assistant who answers in one sentence."
QUESTIONS = [  # one per request: each prompt is new to the consumer's prefix cache
    "Why do cities grow along rivers? Think of trade and water.",
    "Why do ports become capitals? Think of ships and taxes.",
    "Why are old towns built on hills? Think of floods and defence.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "reason": {"type": "string"},
        "examples": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["reason", "examples"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def disagg() -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    with (
        ServerProcess(*INSTANCE, "--kv-role", "producer") as producer,
        ServerProcess(*INSTANCE, "--kv-role", "consumer") as consumer,
        ServerProcess(
            "--prefill",
            producer.url,
            "--decode",
            consumer.url,
            "--prefill-timeout",
            "30",
            command="proxy",
        ) as proxy,
    ):
        yield producer, consumer, proxy


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat(client: openai.OpenAI, model: str, question: str, **options) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages(question), temperature=0, max_tokens=30, **options
    )
    return reply.choices[0].message.content


@pytest.mark.slow
def test_prefill_there_decode_here_equals_one_instance(disagg, client, model_name):
    producer, consumer, proxy = disagg
    via_proxy = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    plain, constrained, streamed = QUESTIONS
    assert chat(via_proxy, model_name, plain) == chat(client, model_name, plain)
    answer = chat(via_proxy, model_name, constrained, response_format=RESPONSE_FORMAT)
    assert answer == chat(client, model_name, constrained, response_format=RESPONSE_FORMAT)
    assert set(json.loads(answer)) == {"reason", "examples"}
    stream = via_proxy.chat.completions.create(
        model=model_name, messages=messages(streamed), temperature=0, max_tokens=30, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat(client, model_name, streamed)

    with httpx.Client(base_url=consumer.url) as http:
        loaded = metrics(http)
    with httpx.Client(base_url=producer.url) as http:
        sent = metrics(http)
    assert loaded["agentrt:kv_transfer_num_loads_total"] == 3
    # At least a block each (the shared system prompt's blocks are loaded once, then cached).
    assert loaded["agentrt:kv_transfer_num_loaded_tokens_total"] >= 3 * 16
    assert loaded["agentrt:kv_transfer_num_load_failures_total"] == 0
    assert (
        sent["agentrt:kv_transfer_num_saved_blocks_total"] * 16
        == loaded["agentrt:kv_transfer_num_loaded_tokens_total"]
    )
    with httpx.Client(base_url=proxy.url) as http:
        assert metrics(http)["agentrt_proxy_prefill_fallbacks_total"] == 0


@pytest.mark.slow
def test_messages_files_batches_and_responses_through_the_proxy(disagg, server, model_name):
    producer, consumer, proxy = disagg
    with httpx.Client(base_url=consumer.url) as http:
        loads_before = metrics(http)["agentrt:kv_transfer_num_loads_total"]
    direct = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    via_proxy = anthropic.Anthropic(base_url=proxy.url, api_key="none", max_retries=0)

    def ask(question: str) -> dict:
        asked = [{"role": "user", "content": question}]
        return dict(model=model_name, max_tokens=20, system=SYSTEM, messages=asked)

    greedy = {"extra_body": {"temperature": 0}}
    # Each question more than a block (16 tokens) past the shared system prompt: a prompt
    # whose new part fills no block has nothing to load.
    whole = "Why do harbours freeze later than lakes? Think of salt, waves, tides and depth."
    streamed = "Why do rivers bend and loop across flat plains? Think of banks, silt and floods."
    expected = direct.messages.create(**ask(whole), **greedy).content[0].text
    assert via_proxy.messages.create(**ask(whole), **greedy).content[0].text == expected
    with via_proxy.messages.stream(**ask(streamed), **greedy) as stream:
        text = "".join(stream.text_stream)
    assert text == direct.messages.create(**ask(streamed), **greedy).content[0].text
    prompt = {k: v for k, v in ask(whole).items() if k != "max_tokens"}
    counted = via_proxy.messages.count_tokens(**prompt).input_tokens
    assert counted == direct.messages.count_tokens(**prompt).input_tokens
    with httpx.Client(base_url=consumer.url) as http:
        # Both decoded the producer's prefill instead of computing it.
        assert metrics(http)["agentrt:kv_transfer_num_loads_total"] == loads_before + 2

    # Stored responses, files and batches: on the decode instance, found again through it.
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    first = client.responses.create(
        model=model_name, input="Name a river.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model=model_name,
        input="And another one.",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id  # found: not a 404
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model_name, "messages": messages(QUESTIONS[0]), "max_tokens": 5},
    }
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch"
    )
    assert client.files.content(uploaded.id).content == json.dumps(line).encode() + b"\n"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.errors
    [output] = client.files.content(batch.output_file_id).text.splitlines()
    assert json.loads(output)["custom_id"] == "one"
    assert json.loads(output)["response"]["status_code"] == 200


def test_a_dead_producer_costs_only_the_local_prefill(disagg, client, model_name):
    producer, consumer, proxy = disagg
    producer.process.send_signal(signal.SIGKILL)
    producer.process.wait()
    via_proxy = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    question = "Why do bridges cross rivers where they are narrow?"
    assert chat(via_proxy, model_name, question) == chat(client, model_name, question)
    with httpx.Client(base_url=proxy.url) as http:
        fallbacks = metrics(http)
    assert fallbacks['agentrt_proxy_prefill_fallbacks_total{reason="unreachable"}'] == 1
