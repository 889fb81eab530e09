"""Every client mistake gets OpenAI's error object with the right 4xx status, through raw
HTTP and through the openai client's typed exceptions, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.agentrt.server.helpers import API_KEY

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


def _chat(**overrides):
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **overrides}


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"temperature": "hot"}, None),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens"),
    ({"max_completion_tokens": 10**7}, "max_completion_tokens"),
    ({"seed": 2**70}, "seed"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"frobnicate": True}, "frobnicate"),
    ({"response_format": {"type": "xml"}}, None),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        None,
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
]


@pytest.mark.parametrize(("overrides", "param"), BAD_CHAT, ids=[str(b[0])[:60] for b in BAD_CHAT])
def test_invalid_chat_requests_are_400(http: httpx.Client, overrides, param):
    _assert_error(http.post("/v1/chat/completions", json=_chat(**overrides)), 400, param)


def test_bad_json_and_wrong_content_type_are_400(http: httpx.Client):
    response = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "JSON" in _assert_error(response, 400)["message"]
    _assert_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400)


def test_prompt_over_the_context_is_400(http: httpx.Client):
    long = "word " * 9000
    error = _assert_error(
        http.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": long}])),
        400,
    )
    assert error["code"] == "context_length_exceeded"
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": long}), 400)


def test_bad_completion_requests_are_400(http: httpx.Client):
    for body, param in [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": ""}, None),
        ({"model": MODEL, "prompt": [10**6]}, None),
        ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
    ]:
        _assert_error(http.post("/v1/completions", json=body), 400, param)
    _assert_error(http.post("/detokenize", json={"tokens": [10**7]}), 400)
    _assert_error(http.post("/tokenize", json={}), 400)


def test_api_key_is_required_everywhere_but_health(server):
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/no/such/route"),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in routes:
            response = httpx.request(method, server.url + path, headers=headers, json=_chat())
            assert _assert_error(response, 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_unknown_model_and_route_are_404(http: httpx.Client, client: openai.OpenAI):
    error = _assert_error(http.post("/v1/chat/completions", json=_chat(model="gpt-9")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    _assert_error(http.get("/v1/models/gpt-9"), 404)
    _assert_error(http.get("/v1/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSG)
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_oversized_body_is_413(http: httpx.Client):
    huge = _chat(messages=[{"role": "user", "content": "x" * 1_200_000}])
    assert _assert_error(http.post("/v1/chat/completions", json=huge), 413)["code"] == (
        "request_too_large"
    )

    def chunks():  # no Content-Length: the limit holds for a chunked body too
        for _ in range(30):
            yield b"x" * 50_000

    _assert_error(http.post("/v1/chat/completions", content=chunks()), 413)


def test_openai_client_raises_typed_errors(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, tool_choice="required")
    assert info.value.status_code == 400 and info.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10**7, stream=True)


def test_the_server_still_serves_after_bad_requests(client: openai.OpenAI, http: httpx.Client):
    assert http.get("/health").status_code == 200
    reply = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert reply.choices[0].message.content is not None
