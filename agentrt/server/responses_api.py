"""`POST /v1/responses` (OpenAI's Responses API, what the OpenAI Agents SDK and
`client.responses.parse` speak), `GET` and `DELETE /v1/responses/{id}`.

A Responses request is served as the chat request it means (`responses_items`): its input
items, after the stored conversation of `previous_response_id`, become chat messages that
the chat template renders; tools, `tool_choice` and `text.format` become the chat
constraint; sampling, limits, metrics and errors are the chat endpoint's. What differs is
the shape of the reply: output items (a message, or function calls), and a stream of typed
events with sequence numbers. Bodies and events are the `openai` package's own Responses
types, so what this server sends is what the official client parses.

A reasoning model's reply reasons first (`agentrt.reasoning`, as in chat): its reasoning is
a `reasoning` output item before the message or calls, its tokens counted apart in
`usage.output_tokens_details.reasoning_tokens`; `reasoning.effort` "none" / "minimal" turns
the thinking off. Reasoning items sent back as input are not shown to the model again.

Not served: built-in (hosted) tools, background runs, conversations and stored prompts are
refused with a 400 naming the field; reasoning summaries are not written.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from openai.types.responses import (
    FunctionTool,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFailedEvent,
    ResponseFormatTextJSONSchemaConfig,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseTextConfig,
    ResponseUsage,
    ToolChoiceFunction,
)
from openai.types.responses import Response as ResponseObject
from openai.types.shared import ResponseFormatJSONObject, ResponseFormatText
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from agentrt.engine.client.outputs import CompletionOutput, RequestDelta, RequestOutput
from agentrt.engine.sampling_params import SamplingParams
from agentrt.reply import ReplyReader
from agentrt.server.chat import chat_turn
from agentrt.server.errors import APIError, bad_request, failed_output, from_exception
from agentrt.server.generation import Generation
from agentrt.server.offload import off_loop
from agentrt.server.params import chat_constraint, choice_params
from agentrt.server.protocol import ChatCompletionRequest, ResponsesRequest
from agentrt.server.response_store import ResponseStore, StoredResponse
from agentrt.server.responses_items import (
    chat_request,
    item_messages,
    output_messages,
    renamed,
)
from agentrt.server.responses_mcp import create_mcp_response
from agentrt.server.responses_mcp_tools import has_mcp_tools
from agentrt.server.responses_output import (
    OutputItems,
    ReplyItems,
    discard,
    dump,
    item_id,
)
from agentrt.server.state import ServerState
from agentrt.tool_formats import tool_call_style
from agentrt.turn import Turn

_PARAM_NAMES = {"prompt": "input", "prompt_token_ids": "input", "max_tokens": "max_output_tokens"}


def add_response_routes(app: FastAPI, store: ResponseStore | None = None) -> None:
    """The Responses routes, over one store of responses (a new one by default)."""
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        if has_mcp_tools(body):  # the MCP servers' tools run here, between turns
            return await create_mcp_response(
                request.app.state.server, store, body, request, create_response
            )
        return await create_response(request.app.state.server, store, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return _stored(store, response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _stored(store: ResponseStore, response_id: str, param: str | None = None) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        what = "Previous response" if param else "Response"
        raise APIError(
            404,
            f"{what} with id {response_id!r} not found: it was never stored (store=false), "
            "was deleted, or has expired from this server's store.",
            param=param,
            code="previous_response_not_found" if param else "response_not_found",
        )
    return stored


async def create_response(
    state: ServerState,
    store: ResponseStore,
    request: ResponsesRequest,
    raw: Request,
    emit=None,
) -> Response | None:
    """The response to `request`: a body, or a stream of events. With `emit` (a turn of a
    longer streamed response: agentrt.server.responses_mcp) the stream's events are sent to
    `emit` instead, and it returns once they all were."""
    state.check_model(request.model)
    _refuse_unsupported(request)
    previous = None
    if request.previous_response_id is not None:
        previous = _stored(store, request.previous_response_id, "previous_response_id")
    history = list(previous.conversation) if previous else []
    conversation = history + item_messages(request.input, history)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    chat = chat_request(request, state.model_name, system + conversation)
    tool_style = tool_call_style(state.engine.tokenizer)
    try:
        constraint = chat_constraint(chat, tool_style)
        turn = await off_loop(state.prompt_limiter, chat_turn, state, chat, constraint)
        params = choice_params(
            chat,
            max_tokens=chat.max_completion_tokens,
            max_tokens_field="max_output_tokens",
            logprobs=chat.top_logprobs if chat.logprobs else None,
            structured=turn.structured,
            cache_salt=state.cache_salt(request.cache_salt, request.user, raw.headers),
        )
    except Exception as exc:
        raise renamed(exc) from None
    generation = Generation(
        state.engine, state.metrics, [turn.prompt_ids], params, param_names=_PARAM_NAMES
    )
    view = ResponseView(state.model_name, request, chat, turn, params[0], state.engine.tokenizer)

    def keep(body: dict[str, Any], output: list[BaseModel]) -> None:
        if request.store is not False:
            messages = conversation + output_messages(output)
            store.put(view.id, body, messages, continues=previous)

    if request.stream:
        firsts = await generation.first_deltas(raw.receive)
        failure = failed_output([d.output for d in firsts if d.output is not None])
        if failure is not None:
            raise failure
        if emit is not None:
            try:
                await view.stream(generation, firsts[0], emit, keep)
            finally:
                generation.abort()
            return None
        return _event_stream(
            lambda emit: view.stream(generation, firsts[0], emit, keep), generation
        )
    outputs = await generation.collect(raw.receive)
    failure = failed_output(outputs)
    if failure is not None:
        raise failure
    output, status = await view.items(outputs[0].outputs[0])
    body = dump(view.response(status, output, outputs[0]))
    keep(body, output)
    return JSONResponse(body)


def _refuse_unsupported(request: ResponsesRequest) -> None:
    for name, what in (
        ("background", "background responses"),
        ("conversation", "conversations (continue with previous_response_id)"),
        ("prompt", "stored prompts"),
    ):
        if getattr(request, name):
            raise bad_request(f"{what} are not supported by this server.", param=name)
    if request.truncation == "auto":
        raise bad_request(
            "truncation='auto' is not supported: the conversation is never cut; an input "
            "longer than the context is refused.",
            param="truncation",
        )


class ResponseView:
    """The Response object of one request and its stream of events."""

    def __init__(
        self,
        model: str,
        request: ResponsesRequest,
        chat: ChatCompletionRequest,
        turn: Turn,
        params: SamplingParams,
        tokenizer: Any,
    ) -> None:
        self.model = model
        self.request = request
        # The reply is read by agentrt.reply as the turn shapes it (as chat reads it: with
        # `text.format` too, calls or the answer) and as `params` decode it.
        self.turn = turn
        self.params = params
        self.tokenizer = tokenizer
        self.id = item_id("resp")
        self.created_at = time.time()
        self.top_n = chat.top_logprobs if chat.logprobs else None
        self.reader: ReplyReader | None = None  # the reply's, once it is read

    # -- bodies ---------------------------------------------------------------------------

    def response(
        self,
        status: str,
        output: list[BaseModel],
        result: RequestOutput | None = None,
        error: APIError | None = None,
    ) -> ResponseObject:
        request = self.request
        fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": self._tool_choice(),
            "tools": [self._tool(t) for t in request.tools or () if t.type == "function"],
            "text": self._text_config(),
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "metadata": request.metadata or {},
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
        }
        for name in ("user", "safety_identifier", "prompt_cache_key", "top_logprobs"):
            if getattr(request, name) is not None:
                fields[name] = getattr(request, name)
        if request.reasoning is not None:
            fields["reasoning"] = request.reasoning.model_dump(exclude_none=True)
        if status == "incomplete":
            fields["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            code = "server_error" if error.status >= 500 else "invalid_prompt"
            fields["error"] = {"code": code, "message": error.message}
        if result is not None:
            fields["usage"] = self._usage(result)
            fields["completed_at"] = time.time()
        return ResponseObject(**fields)

    def _tool_choice(self) -> Any:
        choice = self.request.tool_choice
        if choice is None or isinstance(choice, str):
            return choice or "auto"
        return ToolChoiceFunction(type="function", name=choice.name)

    @staticmethod
    def _tool(tool) -> FunctionTool:
        fields = {"type": "function", "name": tool.name}
        for key in ("description", "parameters", "strict"):
            if getattr(tool, key) is not None:
                fields[key] = getattr(tool, key)
        return FunctionTool(**fields)

    def _text_config(self) -> ResponseTextConfig:
        text_format = self.request.text.format if self.request.text else None
        if text_format is None or text_format.type == "text":
            return ResponseTextConfig(format=ResponseFormatText(type="text"))
        if text_format.type == "json_object":
            return ResponseTextConfig(format=ResponseFormatJSONObject(type="json_object"))
        return ResponseTextConfig(
            format=ResponseFormatTextJSONSchemaConfig(
                **text_format.model_dump(by_alias=True, exclude_none=True)
            )
        )

    def _usage(self, result: RequestOutput) -> ResponseUsage:
        input_tokens = len(result.prompt_token_ids)
        cached = result.num_cached_tokens
        output_ids = result.outputs[0].token_ids
        reasoning = self.reader.num_reasoning_tokens  # as the reply's reader counted them
        return ResponseUsage(
            input_tokens=input_tokens,
            # The prompt tokens computed here enter the prefix cache (in full blocks).
            input_tokens_details={
                "cached_tokens": cached,
                "cache_write_tokens": input_tokens - cached,
            },
            output_tokens=len(output_ids),
            output_tokens_details={"reasoning_tokens": reasoning},
            total_tokens=input_tokens + len(output_ids),
        )

    def _split(self, items: OutputItems) -> ReplyItems:
        self.reader = self.turn.reader(self.tokenizer, self.params)
        return ReplyItems(items, self.reader)

    async def items(self, completion: CompletionOutput) -> tuple[list[BaseModel], str]:
        """The output items of a finished reply (its reasoning, then its function calls or
        one message) and the response's status. They are read as a stream is
        (`OutputItems`, sending nothing), so a reply streamed and one answered in full have
        the same items."""
        items = OutputItems(self.top_n, discard)
        reply = self._split(items)
        await reply.feed(completion.text, completion.token_ids, completion.logprobs)
        return await reply.close(completion.finish_reason), items.status

    # -- the stream -----------------------------------------------------------------------

    async def stream(self, generation: Generation, first: RequestDelta, emit, keep) -> None:
        """Emit the events of the response as the reply streams; `keep(body, output)` the
        finished response before its last event. A failure after the first event is a
        `response.failed`."""
        events = OutputItems(self.top_n, emit)
        reply = self._split(events)
        await events.send(ResponseCreatedEvent, response=self.response("in_progress", []))
        await events.send(ResponseInProgressEvent, response=self.response("in_progress", []))
        try:
            delta = first
            await reply.feed(delta.text, delta.token_ids, delta.logprobs)
            while delta.output is None:
                delta = await generation.next_delta(0)
                await reply.feed(delta.text, delta.token_ids, delta.logprobs)
        except Exception as exc:
            failure = from_exception(exc)
        else:
            failure = failed_output([delta.output])
        if failure is not None:
            response = self.response("failed", events.output, error=failure)
            await events.send(ResponseFailedEvent, response=response)
            return
        output = await reply.close(delta.output.outputs[0].finish_reason)
        status = events.status
        response = self.response(status, output, delta.output)
        done = ResponseCompletedEvent if status == "completed" else ResponseIncompleteEvent
        keep(dump(response), output)  # stored before the client hears it is done
        await events.send(done, response=response)


def _event_stream(produce, generation: Generation) -> EventSourceResponse:
    """`text/event-stream` of named events (`event: <type>`, `data: <json>`), as OpenAI sends
    them (no `[DONE]`). `produce(emit)` runs in the response's task group, so a client
    disconnect cancels it; the engine request is aborted however it ends."""
    send, receive = anyio.create_memory_object_stream[ServerSentEvent]()  # unbuffered

    async def run() -> None:
        async with send:
            try:
                await produce(send.send)
            finally:
                generation.abort()

    return EventSourceResponse(receive, data_sender_callable=run, sep="\n")
