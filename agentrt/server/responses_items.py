"""Responses API input items -> the chat messages they mean, and a Responses request -> the
chat request that serves it (`agentrt.server.chat` renders, constrains and samples it).

One function turns items into messages, for the input of a request and for the output of a
response alike (output items are input items once echoed back), so a conversation continued
with `previous_response_id` and one resent in full render to the same prompt, and the
prefix cache serves both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from agentrt.server.errors import APIError, bad_request, from_exception
from agentrt.server.protocol import (
    ChatCompletionRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContent,
    InputItem,
    InputMessage,
    ResponsesRequest,
)

_ITEMS = pydantic.TypeAdapter(list[InputItem])
_TEXT_PARTS = ("input_text", "output_text", "text")
HOSTED_TOOLS_HINT = (
    "this server runs function tools (the client runs them) and mcp tools (MCP servers its "
    "operator allows); built-in tools such as web search, file search, computer use or code "
    "interpreter are not available"
)

# The chat request's field names -> the Responses request's, for errors.
_PARAM_PREFIXES = (
    ("messages", "input"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("logprobs", "include"),
)


def responses_param(param: str | None) -> str | None:
    """The Responses request's name for a chat request's field."""
    if param is None:
        return None
    for chat, ours in _PARAM_PREFIXES:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat) :]
    return param


def renamed(exc: BaseException) -> APIError:
    """The API error for `exc`, raised while serving the chat request, naming the Responses
    request's field."""
    error = from_exception(exc)
    error.param = responses_param(error.param)
    return error


def item_messages(
    items: str | Sequence[Any],
    history: Sequence[dict[str, Any]] = (),
    *,
    field: str = "input",
) -> list[dict[str, Any]]:
    """Chat messages for input items (a string is one user message) that follow the
    messages of `history`. Consecutive function calls are one assistant message with several
    tool calls; a call's output is a tool message that names the function (called here or
    in `history`). Reasoning items are not shown to the model again (as chat templates of
    reasoning models drop earlier turns' reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    names = {
        call["id"]: call["function"]["name"]
        for message in history
        for call in message.get("tool_calls") or ()
    }
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{field}.{index}"
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content, where)})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last.get("tool_calls") and last["role"] == "assistant":
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            message = {
                "role": "tool",
                "tool_call_id": item.call_id,
                "content": _text(item.output, f"{where}.output"),
            }
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
        elif item.type != "reasoning":
            raise bad_request(
                f"input items of type {item.type!r} are not supported: send messages, "
                "function_call and function_call_output items (and previous_response_id to "
                f"continue a stored response); {HOSTED_TOOLS_HINT}.",
                param=f"{where}.type",
            )
    return messages


def output_messages(output: Sequence[pydantic.BaseModel]) -> list[dict[str, Any]]:
    """The chat messages of a response's output items, read as input items are."""
    items = _ITEMS.validate_python([item.model_dump(mode="json") for item in output])
    return item_messages(items, field="output")


def _text(content: str | list[InputContent], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise bad_request(
                f"content of type {part.type!r} is not supported: this model reads text only "
                "(input_text parts).",
                param=f"{where}.content.{index}",
            )
    return "".join(texts)


def chat_request(
    request: ResponsesRequest, model: str, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that serves `request` over `messages` (the whole conversation,
    instructions first)."""
    if not messages:
        raise bad_request(
            "input is empty: send at least one message (or instructions).", param="input"
        )
    fields: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "max_parallel_tool_calls": request.max_parallel_tool_calls,
        "max_reasoning_tokens": request.max_reasoning_tokens,
        # A reasoning model's switch, as chat reads it ("none" / "minimal": off).
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
    }
    if request.tools:
        fields["tools"] = [_function_tool(i, tool) for i, tool in enumerate(request.tools)]
    fields["tool_choice"] = _tool_choice(request.tool_choice)
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = _response_format(text_format)
    if request.include and "message.output_text.logprobs" in request.include:
        fields["logprobs"] = True
        fields["top_logprobs"] = request.top_logprobs or 0
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{first['msg']}", param=responses_param(param)) from None


def _function_tool(index: int, tool) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(
            f"tools of type {tool.type!r} are not supported: {HOSTED_TOOLS_HINT}.",
            param=f"tools.{index}.type",
        )
    if tool.name is None:
        raise bad_request("a function tool needs a `name`.", param=f"tools.{index}.name")
    function = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        if getattr(tool, key) is not None:
            function[key] = getattr(tool, key)
    return {"type": "function", "function": function}


def _tool_choice(choice) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request(
            f"tool_choice of type {choice.type!r} is not supported: use 'none', 'auto', "
            "'required' or {'type': 'function', 'name': ...}.",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(text_format) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None or text_format.name is None:
        raise bad_request(
            "text.format of type 'json_schema' needs a `name` and a `schema`.",
            param="text.format",
        )
    spec = {"name": text_format.name, "schema": text_format.schema_}
    for key in ("description", "strict"):
        if getattr(text_format, key) is not None:
            spec[key] = getattr(text_format, key)
    return {"type": "json_schema", "json_schema": spec}
