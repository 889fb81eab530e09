"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, what
the official `anthropic` client speaks.

A Messages request is served as the chat request it means, as the Responses endpoint is:
`system` and the messages' blocks become chat messages (`tool_use` an assistant tool call,
`tool_result` a tool message), `tools` and `tool_choice` the chat constraint (`any` is
"required", `tool` that one function: the same grammar-exact calls), `thinking` the
reasoning mode. The prompt is rendered off the event loop (`off_loop`), sampled under the
server's limits and cache isolation (`metadata.user_id` is the user), and the reply read by
`agentrt.reply`, whole or as it streams: `thinking` (signed, and checked when sent back:
messages_thinking), `text` and `tool_use` blocks, streamed as Anthropic's events with
`event:` lines. `usage.input_tokens` counts the prompt tokens computed, as Anthropic's does;
those read from the prefix cache are `cache_read_input_tokens`. Errors take Anthropic's
shape (agentrt.server.errors). A producer's `kv_transfer_params` come back in the body, as
chat's (`agentrt proxy` prefills a message on one instance and decodes it on another).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from agentrt.engine import envs
from agentrt.engine.client.outputs import CompletionOutput, RequestOutput
from agentrt.engine.sampling_params import SamplingParams
from agentrt.server.chat import chat_turn
from agentrt.server.errors import bad_request, failed_output, from_exception
from agentrt.server.generation import Generation
from agentrt.server.messages_protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
)
from agentrt.server.messages_thinking import ThinkingSigner
from agentrt.server.offload import off_loop
from agentrt.server.params import chat_constraint, choice_params
from agentrt.server.protocol import ChatCompletionRequest
from agentrt.server.responses import kv_transfer
from agentrt.server.state import ServerConfig, ServerState
from agentrt.tool_formats import tool_call_style
from agentrt.turn import Turn

# The engine's stop reasons -> Anthropic's (a matched stop string is "stop_sequence").
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def add_messages_routes(app: FastAPI, config: ServerConfig) -> None:
    signer = ThinkingSigner.for_server(
        config.engine_args.kv_secret or envs.kv_secret(), config.model_name
    )

    @app.post("/v1/messages")
    async def create(body: MessagesRequest, request: Request) -> Response:
        return await create_message(request.app.state.server, body, request, signer)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
        state: ServerState = request.app.state.server
        state.check_model(body.model)
        _, turn = await off_loop(state.prompt_limiter, _prepare, state, body)
        return {"input_tokens": len(turn.prompt_ids)}


def _prepare(state: ServerState, request: CountTokensRequest):
    """The chat request that serves `request` and its turn (agentrt.turn): all of it the
    client controls, so it runs off the event loop."""
    chat = chat_request(request, state.model_name)
    constraint = chat_constraint(chat, tool_call_style(state.engine.tokenizer))
    return chat, chat_turn(state, chat, constraint)


async def create_message(
    state: ServerState, request: MessagesRequest, raw: Request, signer: ThinkingSigner
) -> Response:
    state.check_model(request.model)
    signer.check(request.messages)
    chat, turn = await off_loop(state.prompt_limiter, _prepare, state, request)
    user = request.metadata.user_id if request.metadata else None
    params = choice_params(
        chat,
        max_tokens=request.max_tokens,
        max_tokens_field="max_tokens",
        logprobs=None,
        structured=turn.structured,
        cache_salt=state.cache_salt(request.cache_salt, user, raw.headers),
    )
    generation = Generation(
        state.engine, state.metrics, [turn.prompt_ids], params, param_names={"prompt": "messages"}
    )
    view = MessageView(state, turn, params[0], signer)
    view.show_thinking = not (request.thinking and request.thinking.display == "omitted")
    if request.stream:
        firsts = await generation.first_deltas(raw.receive)
        failure = failed_output([d.output for d in firsts if d.output is not None])
        if failure is not None:
            raise failure
        return _event_stream(lambda emit: view.stream(generation, firsts[0], emit), generation)
    outputs = await generation.collect(raw.receive)
    failure = failed_output(outputs)
    if failure is not None:
        raise failure
    return JSONResponse({**view.message(outputs[0]), **kv_transfer(outputs)})


# -- the request, as a chat request -----------------------------------------------------------


def chat_request(request: CountTokensRequest, model: str) -> ChatCompletionRequest:
    """The chat request that serves `request`: its system prompt and messages as chat
    messages, its tools, tool choice, thinking and sampling fields."""
    messages = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for index, message in enumerate(request.messages):
        messages += _chat_messages(message, f"messages.{index}")
    fields: dict[str, Any] = {"model": model, "messages": messages}
    if request.tools:
        fields["tools"] = [_tool(i, tool) for i, tool in enumerate(request.tools)]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a `name`.", "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = _TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    config = request.output_config
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = config.effort
    thinking = request.thinking
    if thinking is not None and thinking.type != "adaptive":  # as chat reads its switch
        enabled = thinking.type == "enabled"
        fields["reasoning_effort"] = fields.get("reasoning_effort", "medium") if enabled else "none"
        fields["max_reasoning_tokens"] = thinking.budget_tokens if enabled else None
    if config is not None and config.format is not None:
        schema = {"name": "output", "schema": config.format.schema_}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if isinstance(request, MessagesRequest):
        for name in ("temperature", "top_p", "top_k"):
            fields[name] = getattr(request, name)
        fields["stop"] = request.stop_sequences
        fields["kv_transfer_params"] = request.kv_transfer_params
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}", param=param) from None


def _chat_messages(message: MessageParam, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message: a user's tool results are tool messages
    (before the text it adds), an assistant's tool_use blocks its tool calls. Thinking
    blocks echoed back are not shown to the model again (as reasoning templates drop an
    earlier turn's reasoning)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(message.content):
        at = f"{where}.content.{index}"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise bad_request("a tool_use block needs an `id` and a `name`.", at)
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise bad_request("a tool_result block needs a `tool_use_id`.", at)
            content = _text(block.content or "", f"{at}.content")
            if block.is_error:
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise bad_request(
                f"content blocks of type {block.type!r} are not supported in a "
                f"{message.role} message: send text, tool_use (assistant) and tool_result "
                "(user) blocks; this model reads text only.",
                f"{at}.type",
            )
    text = "".join(texts)
    if message.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    for index, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"content blocks of type {block.type!r} are not supported here: send text blocks.",
                f"{where}.{index}.type",
            )
    return "".join(block.text for block in content)


def _tool(index: int, tool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"tools of type {tool.type!r} are not supported: this server runs client tools "
            "only (name, description, input_schema); the client runs them.",
            f"tools.{index}.type",
        )
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


# -- the reply, as a message ------------------------------------------------------------------


class MessageView:
    """The message of one request: whole (`message`) or as events (`stream`)."""

    def __init__(
        self, state: ServerState, turn: Turn, params: SamplingParams, signer: ThinkingSigner
    ) -> None:
        self.model = state.model_name
        self.tokenizer = state.engine.tokenizer
        # Read as the turn shapes the reply (with an output format too: calls or the
        # answer) and as `params` decode it.
        self.turn = turn
        self.params = params
        self.show_thinking = True
        self.signer = signer
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def message(self, output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        reply = self.turn.read(self.tokenizer, self.params, completion)
        content: list[dict[str, Any]] = []
        if reply.reasoning and self.show_thinking:
            signature = self.signer.sign(reply.reasoning)
            content.append(
                {"type": "thinking", "thinking": reply.reasoning, "signature": signature}
            )
        calls = reply.calls
        if calls is None or calls.invalid or not calls.calls:
            text = reply.text if calls is None or calls.invalid else reply.content.strip()
            if text:
                content.append({"type": "text", "text": text})
            finish = completion.finish_reason
        else:
            if reply.content.strip():
                content.append({"type": "text", "text": reply.content.strip()})
            for call in calls.calls:
                block = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name}
                content.append({**block, "input": call.arguments})
            finish = calls.finish_reason(completion.finish_reason)
        return self._body(content, *_stop(finish, completion), _output_usage(output))

    def _body(self, content, stop_reason, stop_sequence, usage) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    async def stream(self, generation: Generation, first, emit) -> None:
        """Emit the message's events as the reply streams: each block opened when its first
        text comes, closed when another starts or the reply ends."""
        reader = self.turn.reader(self.tokenizer, self.params)
        blocks = _Blocks(emit, self.show_thinking, self.signer)
        usage = _usage(generation.prompt_lens[0], first.num_cached_tokens, 0)
        start = self._body([], None, None, usage)
        await emit("message_start", {"type": "message_start", "message": start})
        delta = first
        while True:
            read = reader.feed(delta.text, delta.token_ids)
            if delta.output is not None:
                end = reader.finish()
                read.reasoning += end.reasoning
                read.content += end.content
                read.calls += end.calls
            await blocks.add(read)
            if delta.output is not None:
                break
            delta = await generation.next_delta(0)
        failure = failed_output([delta.output])
        if failure is not None:
            raise failure
        await blocks.close()
        completion = delta.output.outputs[0]
        stop_reason, stop_sequence = _stop(
            reader.finish_reason(completion.finish_reason), completion
        )
        usage = _output_usage(delta.output)
        body = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        await emit("message_delta", {"type": "message_delta", "delta": body, "usage": usage})
        await emit("message_stop", {"type": "message_stop"})


class _Blocks:
    """The content blocks of a streamed message: which one is open, and its index. A
    thinking block ends with its signature (a `signature_delta`, as Anthropic's stream)."""

    def __init__(self, emit, show_thinking: bool, signer: ThinkingSigner) -> None:
        self.emit = emit
        self.show_thinking = show_thinking
        self.signer = signer
        self.thinking = ""  # the open thinking block's text so far
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.call: int | None = None  # the open tool_use block's call index

    async def add(self, read) -> None:
        if read.reasoning and self.show_thinking:
            await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self._delta({"type": "thinking_delta", "thinking": read.reasoning})
            self.thinking += read.reasoning
        if read.content:
            await self._open("text", {"type": "text", "text": ""})
            await self._delta({"type": "text_delta", "text": read.content})
        for call in read.calls:
            if "id" in call and call["index"] != self.call:
                await self.close()
                block = {"type": "tool_use", "id": _tool_id(call["id"])}
                block.update(name=call["function"]["name"], input={})
                await self._open("tool_use", block)
                self.call = call["index"]
            arguments = call["function"].get("arguments")
            if arguments:
                await self._delta({"type": "input_json_delta", "partial_json": arguments})

    async def _open(self, kind: str, block: dict[str, Any]) -> None:
        if self.kind == kind and kind != "tool_use":
            return
        await self.close()
        self.index += 1
        self.kind = kind
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        await self.emit("content_block_start", event)

    async def _delta(self, delta: dict[str, Any]) -> None:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        await self.emit("content_block_delta", event)

    async def close(self) -> None:
        if self.kind == "thinking":
            signature = self.signer.sign(self.thinking)
            await self._delta({"type": "signature_delta", "signature": signature})
            self.thinking = ""
        if self.kind is not None:
            event = {"type": "content_block_stop", "index": self.index}
            await self.emit("content_block_stop", event)
        self.kind = None
        self.call = None


def _tool_id(call_id: str) -> str:
    """Anthropic's tool_use id for a call (ids are "toolu_..." there)."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop(finish: str | None, completion: CompletionOutput) -> tuple[str, str | None]:
    """`stop_reason` and `stop_sequence` for a reply that ended with `finish`."""
    if finish == "stop" and isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return _STOP_REASONS.get(finish or "stop", "end_turn"), None


def _output_usage(output: RequestOutput) -> dict[str, int]:
    return _usage(
        len(output.prompt_token_ids), output.num_cached_tokens, len(output.outputs[0].token_ids)
    )


def _usage(num_prompt: int, num_cached: int | None, num_output: int) -> dict[str, int]:
    """Anthropic's usage: the prompt tokens computed, those read from the prefix cache
    apart (the key left out when none were)."""
    cached = num_cached or 0
    usage = {"input_tokens": num_prompt - cached, "output_tokens": num_output}
    if cached:
        usage["cache_read_input_tokens"] = cached
    return usage


def _event_stream(produce, generation: Generation) -> EventSourceResponse:
    """`text/event-stream` of Anthropic's named events (`event: <type>`, `data: <json>`).
    An error after the first event is an `error` event; the engine request is aborted
    however the stream ends (a client disconnect cancels `produce`)."""
    send, receive = anyio.create_memory_object_stream[ServerSentEvent]()  # unbuffered

    async def emit(event: str, data: dict[str, Any]) -> None:
        await send.send(ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=event))

    async def run() -> None:
        async with send:
            try:
                await produce(emit)
            except Exception as exc:
                await emit("error", from_exception(exc).anthropic_body())
            finally:
                generation.abort()

    return EventSourceResponse(receive, data_sender_callable=run, sep="\n")
