"""A real model's parallel calls through the chat endpoint, on the real Qwen2.5 tokenizer:
the engine is scripted to write a reply a Qwen2.5 1.5B model wrote under
`tool_choice="required"` (one call repeated until max_tokens), so what is checked is how
the server reads it. The distinct calls come back, whole and streamed, never the reply as
text; a reply cut inside a call keeps the calls it completed; the cap holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from agentrt.backend import LocalBackend
from agentrt.engine.client.outputs import CompletionOutput, RequestDelta, RequestOutput
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.formats import tools_format
from agentrt.server.chat import create_chat_completion
from agentrt.server.protocol import ChatCompletionRequest, ResponsesRequest
from agentrt.server.response_store import ResponseStore
from agentrt.server.responses_api import create_response
from agentrt.server.state import ServerConfig, ServerState
from agentrt.session import check_completion, collect_completion
from agentrt.tool_formats import tool_call_style

OPEN_ID, CLOSE_ID = 151657, 151658
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "unit_price",
            "description": "The unit price of a product.",
            "parameters": {
                "type": "object",
                "properties": {"product": {"type": "string"}},
                "required": ["product"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What do 3 office chairs and 2 desks cost?"}]


def _call(product: str) -> str:
    arguments = json.dumps({"name": "unit_price", "arguments": {"product": product}})
    return f"<tool_call>\n{arguments}\n</tool_call>"


CHAIR, DESK = _call("office chair"), _call("desk")
# The model's reply: two calls, then the first one again, and again, cut by max_tokens.
REPEATING = "\n".join([CHAIR, DESK, CHAIR, CHAIR, CHAIR[:40]])


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir):
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    assert tool_call_style(tokenizer) == "hermes_tokens"  # the tags are tokens
    return tokenizer


@dataclass
class _Stream:
    """An engine request that writes `reply_ids`, one token a delta, then ends."""

    tokenizer: Any
    prompt_ids: list[int]
    reply_ids: list[int]
    finish: str
    request_id: str = "req-0"
    _at: int = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self._at >= len(self.reply_ids):
            raise StopAsyncIteration
        self._at += 1
        token_id = self.reply_ids[self._at - 1]
        output = None
        if self._at == len(self.reply_ids):
            text = self.tokenizer.decode(self.reply_ids, skip_special_tokens=True)
            completion = CompletionOutput(0, text, list(self.reply_ids), self.finish)
            output = RequestOutput("req-0", None, self.prompt_ids, [completion], finished=True)
        text = self.tokenizer.decode([token_id], skip_special_tokens=True)
        return RequestDelta("req-0", text, [token_id], None, 0, output)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        pass


@dataclass
class _Engine:
    """What the server and the SDK backend use of an `AsyncEngine`, scripted."""

    tokenizer: Any
    reply: str
    finish: str = "length"
    params: list[Any] = field(default_factory=list)
    processor: Any = field(default_factory=lambda: SimpleNamespace(max_model_len=32768))

    def add_request(self, prompt_ids, params, priority: int = 0) -> _Stream:
        self.params.append(params)
        reply_ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        return _Stream(self.tokenizer, prompt_ids, reply_ids, self.finish)

    def abort(self, request_id: str) -> None:
        pass


def _State(engine: _Engine) -> ServerState:
    return ServerState(ServerConfig(served_model_name="qwen2.5"), engine)


class _Raw:
    """The HTTP request: a client that stays connected."""

    headers: dict[str, str] = {}

    async def receive(self) -> dict:
        await anyio.sleep_forever()
        return {}


async def _chat(engine: _Engine, **options) -> tuple[dict, list[dict]]:
    """The whole reply's body and the streamed chunks of the same request."""
    body = {"model": "qwen2.5", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 256}
    body |= {"tool_choice": "required", **options}
    whole = await create_chat_completion(_State(engine), ChatCompletionRequest(**body), _Raw())
    response = await create_chat_completion(
        _State(engine), ChatCompletionRequest(**body, stream=True), _Raw()
    )
    return json.loads(whole.body), await _chunks(response)


async def _chunks(response) -> list[dict]:
    """The `chat.completion.chunk` bodies a streamed response sends."""
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    await response(scope, _Raw().receive, send)
    events = b"".join(sent).decode().split("\n\n")
    chunks = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    return [json.loads(c) for c in chunks if c != "[DONE]"]


def _streamed(chunks: list[dict]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """(content, calls as (name, arguments), finish reasons) of a streamed reply."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or ():
                call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
                call["name"] = part["function"].get("name") or call["name"]
                call["arguments"] += part["function"].get("arguments") or ""
            finishes += [choice["finish_reason"]] if choice["finish_reason"] else []
    named = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    return content, named, finishes


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    ]


DISTINCT = [("unit_price", {"product": "office chair"}), ("unit_price", {"product": "desk"})]


@pytest.mark.anyio
async def test_a_repeated_call_ends_the_calls_whole_and_streamed(qwen):
    engine = _Engine(qwen, REPEATING)
    whole, chunks = await _chat(engine)
    [choice] = whole["choices"]
    assert _calls(choice["message"]) == DISTINCT
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert _streamed(chunks) == ("", DISTINCT, ["tool_calls"])
    # The grammar caps a reply at 8 calls by default.
    assert "){0,7}" in engine.params[0].structured_outputs.spec.text


@pytest.mark.anyio
async def test_a_reply_cut_inside_a_call_keeps_the_calls_before_it(qwen):
    """The bug this guards: cut inside its third call, the whole reply came back as text."""
    cut = "\n".join([CHAIR, DESK, _call("lamp")[:30]])
    whole, chunks = await _chat(_Engine(qwen, cut))
    [choice] = whole["choices"]
    assert _calls(choice["message"]) == DISTINCT and choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert _streamed(chunks) == ("", DISTINCT, ["length"])


@pytest.mark.anyio
async def test_a_reply_cut_inside_its_only_call_is_no_text(qwen):
    whole, _ = await _chat(_Engine(qwen, CHAIR[:30]))
    [choice] = whole["choices"]
    assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


@pytest.mark.anyio
async def test_max_parallel_tool_calls_caps_the_calls(qwen):
    reply = "\n".join([CHAIR, DESK, _call("lamp")])
    engine = _Engine(qwen, reply, finish="stop")
    whole, chunks = await _chat(engine, max_parallel_tool_calls=2)
    [choice] = whole["choices"]
    assert _calls(choice["message"]) == DISTINCT and choice["finish_reason"] == "tool_calls"
    assert _streamed(chunks) == ("", DISTINCT, ["tool_calls"])
    assert "){0,1}" in engine.params[0].structured_outputs.spec.text
    whole, _ = await _chat(_Engine(qwen, reply, finish="stop"))
    assert len(whole["choices"][0]["message"]["tool_calls"]) == 3  # under the default cap


@pytest.mark.anyio
async def test_the_sdk_reads_the_same_distinct_calls(qwen):
    """The SDK's backend on the same reply: the distinct calls, and the reply counts as
    finished (its calls ended at the repeat), not as cut by max_tokens."""
    fmt = tools_format(TOOLS, "required")
    backend = LocalBackend(_Engine(qwen, REPEATING))
    completion = await collect_completion(backend.stream(MESSAGES, fmt, {"max_tokens": 256}))
    assert completion.finish_reason == "stop"
    fmt = tools_format(TOOLS, "required")
    calls = check_completion(completion, fmt, completion.usage)
    assert [(c.name, c.arguments) for c in calls] == DISTINCT


@pytest.mark.anyio
async def test_the_responses_endpoint_takes_max_parallel_tool_calls(qwen):
    """Responses caps the calls as chat does: the grammar's cap, and the calls read past it
    dropped (the reply below writes three distinct ones)."""
    reply = "\n".join([CHAIR, DESK, _call("lamp")])
    body = {"model": "qwen2.5", "input": MESSAGES[0]["content"], "tools": [_responses_tool()]}
    body |= {"tool_choice": "required", "store": False}
    for cap, expected in ((2, DISTINCT), (None, [*DISTINCT, ("unit_price", {"product": "lamp"})])):
        engine = _Engine(qwen, reply, finish="stop")
        request = ResponsesRequest(**body, max_parallel_tool_calls=cap)
        response = await create_response(_State(engine), ResponseStore(), request, _Raw())
        output = json.loads(response.body)["output"]
        calls = [(o["name"], json.loads(o["arguments"])) for o in output]
        assert all(o["type"] == "function_call" for o in output) and calls == expected
        assert f"){{0,{(cap or 8) - 1}}}" in engine.params[0].structured_outputs.spec.text


def _responses_tool() -> dict:
    function = TOOLS[0]["function"]
    return {"type": "function", **function}
