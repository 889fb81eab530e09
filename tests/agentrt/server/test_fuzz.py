"""schemathesis fuzzes every operation of the server's own OpenAPI schema, with bodies that fit
the schema and bodies that break it: no input may produce a 5xx, and the engine must still
serve afterwards. A tiny random model keeps each generation cheap."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.agentrt.server.helpers import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKEN_CAP = 6  # generated token counts are capped so fuzzing stays fast; validation is not


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint) -> Iterator[ServerProcess]:
    model = str(tiny_checkpoint("llama"))
    args = ("--model", model, "--served-model-name", "tiny", "--dtype", "float32")
    with ServerProcess(*args, "--kv-cache-memory-gb", "0.05", "--api-key", API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=AUTH)


# Listed here (and checked against the schema) because schemathesis' own pytest
# parametrization does not work with pytest 9: each operation is drawn from explicitly.
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
]


# POSTs without a JSON body: cancel has none, and an upload is multipart, which schemathesis
# cannot make invalid (bad uploads: tests/agentrt/server/test_batch_api.py).
NO_JSON_BODY = {"/v1/batches/{batch_id}/cancel", "/v1/files"}


def _cheap(body) -> None:
    """Aim most cases at the served model (else they stop at 404) and cap how much they
    generate; every other field stays as generated."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = "tiny"
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and body[key] > TOKEN_CAP:
            body[key] = TOKEN_CAP
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", TOKEN_CAP)
    if "input" in body:
        body.setdefault("max_output_tokens", TOKEN_CAP)
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2:
        body["prompt"] = body["prompt"][:2]


def test_every_operation_is_fuzzed(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_no_input_produces_a_server_error(api_schema, fuzz_server, method, path, mode):
    operation = api_schema[path][method]
    if mode == GenerationMode.NEGATIVE and (method in ("GET", "DELETE") or path in NO_JSON_BODY):
        pytest.skip("nothing to break: no JSON body, and any string is a valid path parameter")
    strategy = operation.as_strategy(generation_mode=mode)

    @given(case=strategy)
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        _cheap(case.body)
        response = case.call(base_url=fuzz_server.url, headers=AUTH, timeout=120)
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
        )
        if response.status_code >= 400 and path.startswith("/v1/messages"):
            body = response.json()  # Anthropic's shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        elif response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}

    check()


def test_the_engine_survives_the_fuzzing(fuzz_server: ServerProcess):
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    reply = httpx.post(
        fuzz_server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
        headers=AUTH,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
