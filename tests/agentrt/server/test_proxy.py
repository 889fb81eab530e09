"""`agentrt proxy` over real sockets: stub prefill and decode instances (small FastAPI apps
that record what they receive) and the proxy, each served by uvicorn on localhost in a
thread, driven with httpx and the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrt.cli import build_parser
from agentrt.server.proxy_app import create_proxy_app, run_proxy
from tests.agentrt.server.helpers import free_port, metrics

AUTH = "Bearer sk-proxy-test"
MESSAGES = [{"role": "user", "content": "Say hello."}]
STREAMED_TEXT = ["Hello", ",", " world", "!"]


class ServerThread:
    """`with ServerThread(app) as server:` serves the ASGI app with uvicorn on a free
    localhost port in a daemon thread; leaving the block stops it."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Stub:
    """A stub instance of `agentrt serve`. `mode`: "ok", "server_error" (500), "bad_request"
    (400), "overloaded" (429), "slow" (answers after 2 s). With `hold_stream`, a stream waits
    after its first chunk until the test sets `first_chunk_seen`."""

    name: str
    calls: list[Call] = field(default_factory=list)
    mode: str = "ok"
    hold_stream: bool = False
    first_chunk_seen: threading.Event = field(default_factory=threading.Event)
    released_by_client: bool | None = None

    def reset(self) -> None:
        self.calls.clear()
        self.mode = "ok"
        self.hold_stream = False
        self.first_chunk_seen.clear()
        self.released_by_client = None

    def kv_params(self, num_call: int) -> dict[str, Any]:
        return {"remote_engine_id": self.name, "remote_block_ids": [1, 2, 3], "call": num_call}


def stub_app(stub: Stub) -> FastAPI:
    app = FastAPI()

    async def complete(request: Request):
        body = await request.json()
        stub.calls.append(Call(request.url.path, body, dict(request.headers)))
        if stub.mode == "server_error":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if stub.mode == "bad_request":
            error = {"message": "messages: field required", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        if stub.mode == "overloaded":
            error = {"message": "too many requests", "type": "requests"}
            return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "1"})
        if stub.mode == "slow":
            await asyncio.sleep(2)
        if body.get("stream"):
            return StreamingResponse(sse_chunks(stub), media_type="text/event-stream")
        kv_params = stub.kv_params(len(stub.calls)) if body.get("kv_transfer_params") else None
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "m"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"decoded by {stub.name}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            "kv_transfer_params": kv_params,
        }

    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/messages", complete, methods=["POST"])  # the shape is not read

    async def echo(request: Request):
        """Any other route: what it received, as JSON (a file's bytes as they came)."""
        body = await request.body()
        stub.calls.append(Call(request.url.path, {}, dict(request.headers)))
        if request.url.path.endswith("/content"):
            return Response(body or b"line 1\nline 2\n", media_type="application/octet-stream")
        return {
            "owner": stub.name,
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "content_type": request.headers.get("content-type"),
            "body": body.decode(),
        }

    for path in ("/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{id}"):
        app.add_api_route(path, echo, methods=["GET", "POST", "DELETE"])
    for path in ("/v1/files", "/v1/files/{id}", "/v1/files/{id}/content"):
        app.add_api_route(path, echo, methods=["GET", "POST", "DELETE"])
    for path in ("/v1/batches", "/v1/batches/{id}", "/v1/batches/{id}/cancel"):
        app.add_api_route(path, echo, methods=["GET", "POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        stub.calls.append(Call("/v1/models", {}, dict(request.headers)))
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": stub.name}]}

    return app


async def sse_chunks(stub: Stub):
    pieces = [{"role": "assistant", "content": ""}] + [{"content": t} for t in STREAMED_TEXT]
    for i, delta in enumerate(pieces + [{}]):
        finish = "stop" if i == len(pieces) else None
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        yield f"data: {json.dumps(chunk)}\n\n"
        if i == 0 and stub.hold_stream:
            # A proxy that buffers the stream never lets the client see this first chunk.
            stub.released_by_client = await asyncio.to_thread(stub.first_chunk_seen.wait, 5)
        await asyncio.sleep(0.01)
    yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, tuple[Stub, str]]]:
    """name -> (stub, url) for "prefill", "decode-a", "decode-b"."""
    with ExitStack() as stack:
        served = {}
        for name in ("prefill", "decode-a", "decode-b"):
            stub = Stub(name)
            served[name] = (stub, stack.enter_context(ServerThread(stub_app(stub))).url)
        yield served


@pytest.fixture
def prefill(stubs) -> Stub:
    for stub, _ in stubs.values():
        stub.reset()
    return stubs["prefill"][0]


@pytest.fixture
def decode(stubs, prefill) -> Stub:
    return stubs["decode-a"][0]


@pytest.fixture
def start_proxy(stubs) -> Iterator[Callable[..., httpx.Client]]:
    """`start_proxy(prefill=[...], decode=[...], **options)` serves a proxy (stub names or
    URLs) and returns an httpx client on it that sends the API key."""
    with ExitStack() as stack:

        def start(
            prefill: list[str] = ("prefill",), decode: list[str] = ("decode-a",), **options
        ) -> httpx.Client:
            urls = [[stubs[u][1] if u in stubs else u for u in urls] for urls in (prefill, decode)]
            server = stack.enter_context(ServerThread(create_proxy_app(*urls, **options)))
            return stack.enter_context(
                httpx.Client(base_url=server.url, headers={"Authorization": AUTH}, timeout=10)
            )

        yield start


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def fallbacks(http: httpx.Client) -> dict[str, float]:
    values = metrics(http)
    reasons = ("unreachable", "timeout", "server_error")
    counts = {r: values[f'agentrt_proxy_prefill_fallbacks_total{{reason="{r}"}}'] for r in reasons}
    return {"requests": values["agentrt_proxy_requests_total"], **counts}


def test_chat_through_the_openai_client(start_proxy, prefill, decode):
    http = start_proxy(upstream_api_key="upstream-key")
    client = openai.OpenAI(
        base_url=str(http.base_url).rstrip("/") + "/v1", api_key="sk-proxy-test", max_retries=0
    )
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7)
    assert reply.choices[0].message.content == "decoded by decode-a"

    (prefill_call,) = prefill.calls
    assert prefill_call.path == "/v1/chat/completions"
    assert prefill_call.body["max_tokens"] == 1
    assert prefill_call.body["stream"] is False
    assert prefill_call.body["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill_call.body["messages"] == MESSAGES
    (decode_call,) = decode.calls
    assert decode_call.body["max_tokens"] == 7
    assert decode_call.body["messages"] == MESSAGES
    assert decode_call.body["kv_transfer_params"] == prefill.kv_params(1)
    # The proxy's own credential upstream, never the client's key.
    upstream = "Bearer upstream-key"
    assert prefill_call.headers["authorization"] == decode_call.headers["authorization"] == upstream

    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(STREAMED_TEXT)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert prefill.calls[1].body["stream"] is False
    assert decode.calls[1].body["stream"] is True
    assert decode.calls[1].body["kv_transfer_params"] == prefill.kv_params(2)
    assert fallbacks(http) == {"requests": 2, "unreachable": 0, "timeout": 0, "server_error": 0}


def test_bodies_and_a_stream_passed_through_unbuffered(start_proxy, prefill, decode):
    http = start_proxy()
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_completion_tokens": 9,
        "min_tokens": 3,
        "n": 1,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    decode.hold_stream = True
    events = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                decode.first_chunk_seen.set()
    assert decode.released_by_client is True, "the proxy held back the first chunk"
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(deltas) == "".join(STREAMED_TEXT)

    assert prefill.calls[0].body == {
        "model": "m",
        "messages": MESSAGES,
        "temperature": 0.5,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode.calls[0].body == {**body, "kv_transfer_params": prefill.kv_params(1)}


def test_completions_json_and_status_relayed(start_proxy, prefill, decode):
    http = start_proxy()
    response = http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["choices"][0]["message"]["content"] == "decoded by decode-a"
    assert [c.path for c in prefill.calls + decode.calls] == ["/v1/completions"] * 2
    assert decode.calls[0].body == {
        "model": "m",
        "prompt": "Hi",
        "max_tokens": 4,
        "kv_transfer_params": prefill.kv_params(1),
    }

    decode.mode = "overloaded"
    response = http.post("/v1/completions", json={"model": "m", "prompt": "Hi"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "requests"


def test_unreachable_prefill_falls_back_to_the_decode_instance(start_proxy, prefill, decode):
    http = start_proxy(prefill=[dead_url()])
    body = {"model": "m", "messages": MESSAGES, "kv_transfer_params": {"from": "client"}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "decoded by decode-a"
    # The client's own kv_transfer_params do not pass either: the field is the proxy's.
    assert decode.calls[0].body == {"model": "m", "messages": MESSAGES}
    assert fallbacks(http) == {"requests": 1, "unreachable": 1, "timeout": 0, "server_error": 0}


def test_prefill_server_error_falls_back(start_proxy, prefill, decode):
    http = start_proxy()
    prefill.mode = "server_error"
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 200
    assert len(prefill.calls) == 1
    assert "kv_transfer_params" not in decode.calls[0].body
    assert fallbacks(http) == {"requests": 1, "unreachable": 0, "timeout": 0, "server_error": 1}


def test_slow_prefill_times_out_and_falls_back(start_proxy, prefill, decode):
    http = start_proxy(prefill_timeout_s=0.5)
    prefill.mode = "slow"
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    elapsed = time.monotonic() - start
    assert response.status_code == 200
    assert 0.5 <= elapsed < 1.8, elapsed
    assert "kv_transfer_params" not in decode.calls[0].body
    assert fallbacks(http) == {"requests": 1, "unreachable": 0, "timeout": 1, "server_error": 0}


def test_prefill_client_error_is_returned_without_decoding(start_proxy, prefill, decode):
    http = start_proxy()
    prefill.mode = "bad_request"
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": "messages: field required", "type": "invalid_request_error"}
    }
    assert decode.calls == []
    assert fallbacks(http) == {"requests": 1, "unreachable": 0, "timeout": 0, "server_error": 0}


def test_a_body_the_decode_instance_would_refuse_is_refused_before_the_prefill(
    start_proxy, prefill, decode
):
    # The prefill leg drops `n`: an n the decode instance refuses used to be prefilled, and
    # its blocks held for a decode that never came (120 s).
    http = start_proxy()
    for body in (
        {"model": "m", "messages": MESSAGES, "n": 1000},
        {"model": "m"},
        {"model": "m", "messages": MESSAGES, "stop": ["x" * 5000]},
        {"model": "m", "messages": MESSAGES, "min_tokens": 9, "max_tokens": 2},
    ):
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert prefill.calls == [] and decode.calls == []


def test_a_busy_prefill_instance_falls_back_to_a_local_prefill(start_proxy, prefill, decode):
    # A producer that holds all it may for consumers answers 429: relayed, it made every
    # client wait while any decode instance could prefill the request itself.
    http = start_proxy()
    prefill.mode = "overloaded"
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "decoded by decode-a"
    assert "kv_transfer_params" not in decode.calls[0].body
    values = metrics(http)
    assert values['agentrt_proxy_prefill_fallbacks_total{reason="overloaded"}'] == 1


def test_decode_down_gives_502(start_proxy, prefill):
    http = start_proxy(decode=[dead_url()])
    for response in (
        http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}),
        http.get("/v1/models"),
    ):
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "bad_gateway"
        assert "decode instance" in error["message"]


def test_round_robin_over_decode_instances(start_proxy, prefill, stubs):
    http = start_proxy(decode=["decode-a", "decode-b"])
    replies = [
        http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}).json()
        for _ in range(4)
    ]
    owners = [r["choices"][0]["message"]["content"].removeprefix("decoded by ") for r in replies]
    assert owners == ["decode-a", "decode-b", "decode-a", "decode-b"]
    assert len(prefill.calls) == 4
    assert len(stubs["decode-a"][0].calls) == len(stubs["decode-b"][0].calls) == 2


def test_stateful_routes_go_to_the_first_decode_instance(start_proxy, prefill, stubs):
    # A stored response, a file or a batch lives on one instance: round-robin would send the
    # request that reads it back elsewhere (previous_response_id not found, a 404 file).
    http = start_proxy(decode=["decode-a", "decode-b"], upstream_api_key="upstream-key")
    owners = []
    for _ in range(2):
        for method, path in (
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("GET", "/v1/files"),
            ("GET", "/v1/files/file-1"),
            ("DELETE", "/v1/files/file-1"),
            ("GET", "/v1/batches"),
            ("GET", "/v1/batches/batch_1"),
            ("POST", "/v1/batches/batch_1/cancel"),
        ):
            response = http.request(method, path, json={} if method == "POST" else None)
            assert response.status_code == 200, (path, response.text)
            echoed = response.json()
            assert (echoed["method"], echoed["path"]) == (method, path)
            owners.append(echoed["owner"])
    assert set(owners) == {"decode-a"}
    # A multipart upload keeps its content type and bytes; a query string passes; a file's
    # bytes come back as they are; the credential upstream is the proxy's.
    upload = http.post(
        "/v1/files", files={"file": ("in.jsonl", b'{"a": 1}\n')}, data={"purpose": "batch"}
    )
    echoed = upload.json()
    assert echoed["content_type"].startswith("multipart/form-data; boundary=")
    assert 'filename="in.jsonl"' in echoed["body"] and '{"a": 1}' in echoed["body"]
    listed = http.get("/v1/batches", params={"after": "batch_1", "limit": 2}).json()
    assert listed["query"] == "after=batch_1&limit=2"
    content = http.get("/v1/files/file-1/content")
    assert content.content == b"line 1\nline 2\n"
    assert content.headers["content-type"] == "application/octet-stream"
    decode_a = stubs["decode-a"][0]
    assert {c.headers["authorization"] for c in decode_a.calls} == {"Bearer upstream-key"}
    assert stubs["decode-b"][0].calls == [] and prefill.calls == []

    # count_tokens holds nothing: the decode instances in turn, no prefill.
    for owner in ("decode-a", "decode-b"):
        body = {"model": "m", "messages": MESSAGES}
        counted = http.post("/v1/messages/count_tokens", json=body).json()
        assert counted["owner"] == owner and json.loads(counted["body"]) == body
    assert prefill.calls == []


def test_messages_are_prefilled_and_decoded(start_proxy, prefill, decode):
    http = start_proxy()
    body = {"model": "m", "max_tokens": 9, "messages": MESSAGES, "stop_sequences": ["."]}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert prefill.calls[0].path == decode.calls[0].path == "/v1/messages"
    assert prefill.calls[0].body == {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert decode.calls[0].body == {**body, "kv_transfer_params": prefill.kv_params(1)}
    # A body the instances would refuse is refused here, in Anthropic's shape.
    for bad in ({"model": "m", "messages": MESSAGES}, {**body, "top_k": 0}, {**body, "x": 1}):
        refused = http.post("/v1/messages", json=bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["type"] == "error"
        assert refused.json()["error"]["type"] == "invalid_request_error"
    assert len(prefill.calls) == len(decode.calls) == 1


def test_models_health_and_invalid_json(start_proxy, prefill, decode, stubs):
    http = start_proxy()
    models = http.get("/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["owned_by"] == "decode-a"
    assert "authorization" not in decode.calls[0].headers  # the client's key stays here

    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}  # no upstream addresses (test_proxy_security)

    bad = http.post("/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert prefill.calls == [] and len(decode.calls) == 1


def test_cli_arguments(capsys):
    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--decode", "http://d:2/"]
    )
    assert (args.prefill, args.decode) == (["http://p:1"], ["http://d:1", "http://d:2/"])
    assert (args.host, args.port, args.prefill_timeout) == ("127.0.0.1", 8000, 60.0)

    args.decode = ["d:3"]
    assert run_proxy(args) == 2
    assert "must start with http://" in capsys.readouterr().err
