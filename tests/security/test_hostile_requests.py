"""Hostile requests against a real `agentrt serve` on the embedded model (issue #42). Each one
runs while a victim polls /health and sends 2-token completions; each test asserts that

- every victim round stays within 2x its idle latency plus 1 s,
- the hostile request gets a clear 4xx, or a bounded answer,
- nothing else is affected: the server is healthy and a reference greedy completion is
  unchanged afterwards.
"""

from __future__ import annotations

import json

import httpx
import pytest

# The schema that froze the server: jsonschema checks each level of these arrays twice.
from tests.grammar.test_validate import SELF_ANY_OF
from tests.security.victim import MODEL, Attack, Victim

MESSAGES = [{"role": "user", "content": "Write nested JSON arrays."}]
REFERENCE = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def reference(http: httpx.Client) -> str:
    reply = http.post("/v1/completions", json=REFERENCE)
    assert reply.status_code == 200
    return reply.json()["choices"][0]["text"]


@pytest.fixture
def attack(victim: Victim, http: httpx.Client, reference: str):
    """`attack(hostile)`: run it under the victim's eye, check the victim and the server
    afterwards, and return the Attack."""
    done: list[Attack] = []

    def run(hostile, timeout_s: float = 120) -> Attack:
        result = victim.during(hostile, timeout_s)
        done.append(result)
        return result

    yield run
    for result in done:
        victim.check(result)
        print(
            f"\nvictim idle {victim.idle_s:.2f} s, slowest round under attack "
            f"{max(result.victim_rounds):.2f} s (bound {victim.bound_s:.2f} s); hostile "
            f"request {result.seconds:.2f} s -> "
            f"{result.response.status_code if result.response is not None else 'timeout'}"
        )
    assert http.get("/health").status_code == 200
    after = http.post("/v1/completions", json=REFERENCE)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference


def chat(client: httpx.Client, **fields) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields}
    )


def complete(client: httpx.Client, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **fields})


def assert_client_error(response: httpx.Response | None, *words: str) -> None:
    assert response is not None, "the hostile request timed out"
    assert 400 <= response.status_code < 500, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_the_first_structured_request_does_not_stall_others(attack) -> None:
    """The first in the server's life (this file's first test; test_defaults.py sends none):
    the grammar compiler, built in the background from engine start, is ready or still
    building, never built on the engine thread while the victim waits."""
    choice = {"choice": ["yes", "no"]}
    result = attack(lambda c: complete(c, structured_outputs=choice, max_tokens=2))
    assert result.response is not None and result.response.status_code == 200
    assert result.response.json()["choices"][0]["text"] in ("yes", "no")


def test_a_schema_whose_final_check_explodes_gets_a_bounded_answer(attack) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "nested", "schema": SELF_ANY_OF},
    }
    result = attack(lambda c: chat(c, response_format=response_format, max_tokens=48))
    assert result.response is not None and result.response.status_code == 200
    assert result.seconds < 60
    json.loads(result.response.json()["choices"][0]["message"]["content"] or "[]")


def test_a_huge_stop_string_is_refused(attack) -> None:
    result = attack(lambda c: complete(c, stop=["x" * 200_000], max_tokens=32))
    assert_client_error(result.response, "stop", "4096")


def test_stop_strings_at_the_cap_cost_linear_time(attack) -> None:
    stops = [("ab" * 2048)[: 4096 - i] for i in range(16)]
    result = attack(lambda c: complete(c, stop=stops, max_tokens=32, ignore_eos=True))
    assert result.response is not None and result.response.status_code == 200
    assert result.seconds < 30


def test_a_client_chat_template_is_refused(attack) -> None:
    injected = "{{ raise_exception('INJECTED') }}"
    result = attack(lambda c: chat(c, chat_template_kwargs={"chat_template": injected}))
    assert_client_error(result.response, "not a template variable")
    assert "INJECTED" not in result.response.text


@pytest.mark.parametrize("depth", [400, 5000])
def test_a_deeply_nested_regex_is_a_400(attack, depth: int) -> None:
    regex = "(a|" * depth + "b" + ")" * depth
    result = attack(lambda c: complete(c, structured_outputs={"regex": regex}, max_tokens=4))
    assert_client_error(result.response, "nested too deeply")


def test_a_deeply_nested_schema_text_is_a_400(attack) -> None:
    text = '{"items":' * 5000 + "{}" + "}" * 5000
    result = attack(lambda c: complete(c, structured_outputs={"json": text}, max_tokens=4))
    assert_client_error(result.response, "nested too deeply")


def test_a_body_nested_past_the_recursion_limit_is_a_400(attack) -> None:
    nested = "[" * 100_000 + "]" * 100_000
    body = '{"model": "%s", "prompt": "x", "logit_bias": %s}' % (MODEL, nested)  # noqa: UP031
    headers = {"content-type": "application/json"}
    result = attack(lambda c: c.post("/v1/completions", content=body, headers=headers))
    assert_client_error(result.response)


def test_an_8_mib_prompt_is_refused_before_it_is_tokenized(attack) -> None:
    prompt = "lorem ipsum dolor sit amet " * 300_000  # 8.1 MB: under the body limit
    result = attack(lambda c: complete(c, prompt=prompt[: 7 * 2**20], max_tokens=1))
    assert_client_error(result.response, "characters")
    assert result.seconds < 10


def test_a_huge_chat_message_does_not_stall_others(attack) -> None:
    content = "lorem ipsum dolor sit amet " * 250_000
    messages = [{"role": "user", "content": content[: 6 * 2**20]}]
    result = attack(
        lambda c: c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    )
    assert_client_error(result.response)


def test_a_non_ascii_kv_signature_is_a_400(attack) -> None:
    params = {"remote_key": "0" * 64, "expires": 9e9, "signature": "é" * 64}
    result = attack(lambda c: complete(c, kv_transfer_params=params, max_tokens=1))
    assert_client_error(result.response, "kv_transfer_params")


def test_another_tenants_prefix_cache_is_not_seen(attack, http: httpx.Client) -> None:
    prompt = "The secret plan of tenant A is to open a bakery on the corner. " * 8

    def cached(client: httpx.Client, salt: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(http, "tenant-a") == 0
    assert cached(http, "tenant-a") > 0  # the tenant's own hits
    result = attack(lambda c: c.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"
    }))  # fmt: skip
    assert result.response is not None and result.response.status_code == 200
    assert result.response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_responses_leak_no_paths_or_exception_text(http: httpx.Client, server) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert "/" not in json.dumps(card)
    assert card["root"] == card["id"] == MODEL


def test_a_body_of_a_quarter_million_messages_is_refused_before_validating_them(attack) -> None:
    # Validating 250,000 message objects took seconds of the event loop (/health included).
    messages = [{"role": "user", "content": "x"}] * 250_000
    result = attack(
        lambda c: c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    )
    assert_client_error(result.response, "at most 4096")


def test_one_request_cannot_fill_the_engine_with_choices(attack) -> None:
    # 16 prompts x n=16 queued 256 engine requests from one HTTP request ahead of everyone
    # (the victim's 2-token completion timed out after 60 s); 64 prompts slowed it to 1.9 s.
    flood = {"prompt": ["Tell me a story."] * 16, "n": 16, "max_tokens": 64, "ignore_eos": True}
    result = attack(lambda c: complete(c, **flood))
    assert_client_error(result.response, "at most 16")
    most = {"prompt": ["Tell me a story."] * 16, "max_tokens": 64, "ignore_eos": True}
    result = attack(lambda c: complete(c, **most))
    assert result.response is not None and result.response.status_code == 200
    assert len(result.response.json()["choices"]) == 16
