"""The Responses API's `{"type": "mcp", ...}` tools: this server connects to the MCP server,
lists its tools, lets the model call them and runs the calls itself, as OpenAI's API does.

A client must not make this server reach a host of its choosing: `server_url` must be one
of `agentrt serve --allow-mcp-servers` exactly (a streamable HTTP URL, or a command that
serves MCP on stdin/stdout), else the request is a 400 before any connection is made. With
no allow-list, mcp tools are refused.

One request runs as a loop of ordinary Responses turns (`respond`, the endpoint's own,
non-streamed and unstored): the MCP tools are offered as function tools whose schemas are
the server's, so calls are grammar-exact; a call the model makes is run on the MCP server
(an `mcp_call` item, its output sent back to the model) and the model writes again, until
it answers, calls a client's function tool, or a call needs approval. `require_approval`
("always", the default as in OpenAI's API; "never"; or `{"always"|"never": {"tool_names"}}`)
makes such a call an `mcp_approval_request` item that ends the response; the client answers
with an `mcp_approval_response` input item (`approve`, after `previous_response_id` or with
the request item echoed back), and the approved call runs at the start of the next response.
The output begins with one `mcp_list_tools` item per server the conversation has not listed
yet (as OpenAI's API: after `previous_response_id`, a server listed before with the same
URL and allowed_tools is not listed again, its stored list is used, and it is contacted only
when a call runs). After `MAX_MCP_STEPS` turns the last one is offered no MCP tool.
Sessions come from the server's pool (responses_mcp_sessions: kept open between requests).
Streamed, the turns run through `respond` streamed, in the response's own task, and their
events are sent on as they come (agentrt.server.responses_mcp_stream): the model's text in
as many deltas as a plain streamed response, each mcp_call item's arguments as the model
writes them, its output once the call ran. Whole or streamed, a response is the same loop
and the same items, in the order the model wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from agentrt.errors import MCPServerError
from agentrt.mcp import MCPToolError, mcp_server
from agentrt.server.errors import APIError, bad_request, from_exception
from agentrt.server.generation import ClientDisconnected
from agentrt.server.protocol import InputItem, ResponsesRequest
from agentrt.server.response_store import ResponseStore
from agentrt.server.responses_items import item_messages
from agentrt.server.responses_mcp_sessions import MCPSessionPool
from agentrt.server.responses_mcp_stream import MCPEvents
from agentrt.server.responses_mcp_tools import (
    MCPServerTool,
    checked_servers,
    echoed_tools,
    first_tool_choice,
    function_tool,
)
from agentrt.server.responses_output import item_id
from agentrt.server.state import ServerState
from agentrt.tools import Tool

MAX_MCP_STEPS = 4  # model turns in one response; the last is offered no MCP tool
_ITEMS = pydantic.TypeAdapter(list[InputItem])
# The Responses endpoint's own (`create_response`): a body, or with `emit=` a streamed turn
# whose events go to `emit`.
Respond = Callable[..., Awaitable[Response | None]]


async def create_mcp_response(
    state: ServerState,
    store: ResponseStore,
    request: ResponsesRequest,
    raw: Request,
    respond: Respond,
) -> Response:
    """Serve a Responses request that has mcp tools (see the module docstring)."""
    servers = checked_servers(request, state.config.allow_mcp_servers)
    previous = store.get(request.previous_response_id) if request.previous_response_id else None
    known = previous.mcp_listings if previous is not None else {}
    pool = getattr(raw.app.state, "mcp_sessions", None)  # the app's (an empty one is falsy)
    if pool is None:
        pool = MCPSessionPool()  # not running: each session is the request's own
    async with AsyncExitStack() as stack:
        sessions = _Sessions(pool, stack)
        output = []
        for server in servers:
            listing = known.get(server.label)
            if listing is not None and listing["key"] == _listing(server):
                server.tools = listing["tools"]
            else:
                output.append(await _list_tools(server, sessions))
        tools = _tools_by_name(request, servers)
        inputs = await _input_items(request, previous, tools, output, sessions)
        response = _MCPResponse(state, store, request, raw, respond, servers, tools, previous)
        if not request.stream:
            return JSONResponse(await response.run(inputs, output, sessions))
    # Streamed, the turns run in the response's own task, which opens (from the pool) the
    # sessions it calls: a session is left in the task that entered it.
    for server in servers:
        server.session = None
    return _event_stream(response, inputs, output, pool)


@dataclass(slots=True)
class _MCPResponse:
    """One response's turns (see the module docstring): `run` them, whole or streamed."""

    state: ServerState
    store: ResponseStore
    request: ResponsesRequest
    raw: Request
    respond: Respond
    servers: list[MCPServerTool]
    tools: dict[str, tuple[MCPServerTool, dict[str, Any]]]
    previous: Any
    id: str = field(default_factory=lambda: item_id("resp"))
    items: dict[str, dict[str, Any]] = field(default_factory=dict)  # call_id -> its MCP item

    def fields(self) -> dict[str, Any]:
        """What the body says whatever its turns say: the tools and tool_choice as sent."""
        choice = self.request.tool_choice or "auto"
        functions = [
            t.model_dump(exclude_none=True) for t in self.request.tools if t.type == "function"
        ]
        return {
            "tools": echoed_tools(self.request, functions, self.tools),
            "tool_choice": choice
            if isinstance(choice, str)
            else choice.model_dump(exclude_none=True),
        }

    async def run(
        self,
        inputs: list[dict[str, Any]],
        output: list[dict[str, Any]],
        sessions: _Sessions,
        events: MCPEvents | None = None,
    ) -> dict[str, Any]:
        """Run the turns (their events sent to `events` as they happen, when streamed);
        the response's body, stored unless store=false."""
        request, tools = self.request, self.tools
        client_tools = [t.model_dump(exclude_none=True) for t in request.tools if t.type != "mcp"]
        mcp_tools = [function_tool(tool) for _, tool in tools.values()]
        choice = first_tool_choice(request.tool_choice)
        usage: dict[str, Any] | None = None
        for step in range(MAX_MCP_STEPS):
            offered = client_tools + (mcp_tools if step < MAX_MCP_STEPS - 1 else [])
            fields = request.model_dump(exclude_none=True, by_alias=True)
            fields.update(input=inputs, tools=offered or None, tool_choice=choice)
            fields.update(stream=events is not None, store=False)
            if not offered:
                fields.pop("tool_choice")
            body = await self._one_turn(fields, events)
            usage = _add_usage(usage, body.get("usage"))
            failed = body["status"] == "failed"
            ran = pending = client_call = False
            # The turn's items in its order (a streamed turn has sent them, and opened its
            # mcp_call items); a failed turn's calls do not run.
            for item in body["output"]:
                mcp_item = self.mcp_item(item)
                if mcp_item is None:
                    output.append(item)
                    inputs.append(item)
                    client_call |= item["type"] == "function_call"
                elif failed:
                    continue
                elif mcp_item["type"] == "mcp_approval_request":
                    output.append(mcp_item)
                    pending = True
                else:
                    await _run(tools[item["name"]][0], sessions, mcp_item, events)
                    output.append(mcp_item)
                    inputs += _call_items(mcp_item)
                    ran = True
            if not ran or pending or client_call:
                break
            choice = "none" if request.tool_choice == "none" else "auto"
        body.update(id=self.id, output=output, usage=usage, **self.fields())
        if request.store is not False and body["status"] != "failed":
            previous = self.previous
            history = list(previous.conversation) if previous else []
            messages = history + item_messages(_ITEMS.validate_python(inputs), history)
            listings = dict(previous.mcp_listings) if previous is not None else {}
            for server in self.servers:
                listings[server.label] = {"key": _listing(server), "tools": server.tools}
            self.store.put(body["id"], body, messages, continues=previous, mcp_listings=listings)
        return body

    def mcp_item(self, item: dict[str, Any]) -> dict[str, Any] | None:
        """The item a turn's function call of an MCP tool stands for (None for any other
        item): an mcp_approval_request, or an mcp_call to run. Made once a call (a streamed
        turn asks as the call opens), its arguments those of the call as last seen."""
        if item["type"] != "function_call" or item["name"] not in self.tools:
            return None
        mcp_item = self.items.get(item["call_id"])
        if mcp_item is None:
            server, _ = self.tools[item["name"]]
            if server.needs_approval(item["name"]):
                mcp_item = _approval_request(server, item)
            else:
                mcp_item = _mcp_call(server, item["name"], item["arguments"])
            self.items[item["call_id"]] = mcp_item
        mcp_item["arguments"] = item["arguments"]
        return mcp_item

    async def _one_turn(self, fields: dict[str, Any], events: MCPEvents | None) -> dict[str, Any]:
        """One ordinary Responses turn: its body (streamed: its events sent on as they come,
        its calls of MCP tools as their items)."""
        if events is None:
            return json.loads(
                (await self.respond(self.state, self.store, _turn(fields), self.raw)).body
            )
        turn = events.turn(self.mcp_item)
        await self.respond(self.state, self.store, _turn(fields), self.raw, emit=turn)
        if turn.final is None:
            raise APIError(500, "a turn of the response ended without its last event.")
        return turn.final


def _listing(server: MCPServerTool) -> list[Any]:
    """What a stored listing holds for: a server is listed again if this changes."""
    return [server.target, server.allowed_tools]


@dataclass(slots=True)
class _Sessions:
    """Where a request's MCP sessions come from (the server's pool: kept between requests)
    and what gives them back when it ends."""

    pool: MCPSessionPool
    stack: AsyncExitStack


async def _list_tools(server: MCPServerTool, sessions: _Sessions) -> dict[str, Any]:
    """Connect and list the server's tools: the `mcp_list_tools` item."""
    listed = await _connect(server, sessions, list_tools=True)
    server.tools = [
        {"name": t.name, "description": t.description, "input_schema": t.parameters} for t in listed
    ]
    return {
        "id": item_id("mcpl"),
        "type": "mcp_list_tools",
        "server_label": server.label,
        "tools": server.tools,
    }


async def _connect(server: MCPServerTool, sessions: _Sessions, *, list_tools: bool) -> list[Tool]:
    """The server's session, from the pool (given back with the request's stack). A server
    that cannot be reached is a 424, as in OpenAI's API."""
    new = mcp_server(server.target, headers=server.headers, allowed_tools=server.allowed_tools)
    kept = sessions.pool.session(server.session_key, new, list_tools=list_tools)
    try:
        server.session = await sessions.stack.enter_async_context(kept)
    except MCPServerError as exc:
        raise APIError(
            424,
            f"Error retrieving tool list from MCP server {server.label!r}: {exc}",
            param=f"tools.{server.index}.server_url",
            code="mcp_server_error",
        ) from None
    return server.session.tools


def _tools_by_name(
    request: ResponsesRequest, servers: list[MCPServerTool]
) -> dict[str, tuple[MCPServerTool, dict[str, Any]]]:
    names = {t.name for t in request.tools or () if t.type == "function"}
    tools: dict[str, tuple[MCPServerTool, dict[str, Any]]] = {}
    for server in servers:
        for tool in server.tools:
            if tool["name"] in names or tool["name"] in tools:
                raise bad_request(
                    f"tool {tool['name']!r} of MCP server {server.label!r} has the name of "
                    "another tool: use allowed_tools to leave one out.",
                    param=f"tools.{server.index}.allowed_tools",
                )
            tools[tool["name"]] = (server, tool)
    return tools


async def _input_items(
    request: ResponsesRequest,
    previous: Any,
    tools: dict[str, tuple[MCPServerTool, dict[str, Any]]],
    output: list[dict[str, Any]],
    sessions: _Sessions,
) -> list[dict[str, Any]]:
    """The request's input as the items an ordinary turn reads: MCP items become the
    function calls and outputs they stand for; an approved call runs now (its `mcp_call`
    item joins `output`), a declined one tells the model so."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    asked = {
        item["id"]: item
        for item in (previous.body["output"] if previous is not None else ())
        if item.get("type") == "mcp_approval_request"
    }
    items: list[dict[str, Any]] = []
    for index, item in enumerate(request.input):
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        kind = data.get("type", "message")
        if kind in ("mcp_approval_request", "mcp_call"):
            _check_strings(data, ("id", "server_label", "name", "arguments"), index)
        if kind == "mcp_approval_request":
            asked[data["id"]] = data
        elif kind == "mcp_call":
            items += _call_items(data)
        elif kind == "mcp_approval_response":
            approval = asked.get(data.get("approval_request_id"))
            name = approval and approval.get("name")
            if name not in tools or tools[name][0].label != approval.get("server_label"):
                raise bad_request(
                    f"approval_request_id {data.get('approval_request_id')!r} names no "
                    "approval request of this conversation for the mcp tools of this request.",
                    param=f"input.{index}.approval_request_id",
                )
            if data.get("approve") is True:
                server = tools[name][0]
                call = _mcp_call(server, name, approval["arguments"], approval["id"])
                await _run(server, sessions, call)
                output.append(call)
            else:
                reason = data.get("reason")
                call = {**approval, "id": item_id("mcp"), "type": "mcp_call", "output": None}
                call["error"] = "The user declined this call" + (f": {reason}" if reason else ".")
            items += _call_items(call)
        elif kind != "mcp_list_tools":
            items.append(data)
    return items


def _turn(fields: dict[str, Any]) -> ResponsesRequest:
    """One turn's request; input items the client sent that make no valid turn are a 400."""
    try:
        return ResponsesRequest(**fields)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", param="input") from None


def _check_strings(data: dict[str, Any], fields: tuple[str, ...], index: int) -> None:
    if not all(isinstance(data.get(key), str) for key in fields):
        raise bad_request(
            f"an {data['type']} item needs the strings {', '.join(fields)}.",
            param=f"input.{index}",
        )


def _mcp_call(
    server: MCPServerTool, name: str, arguments: str, approval_request_id: str | None = None
) -> dict[str, Any]:
    """An `mcp_call` item not run yet."""
    item: dict[str, Any] = {
        "id": item_id("mcp"),
        "type": "mcp_call",
        "server_label": server.label,
        "name": name,
        "arguments": arguments,
        "output": None,
        "error": None,
        "status": "in_progress",
    }
    if approval_request_id is not None:
        item["approval_request_id"] = approval_request_id
    return item


async def _run(
    server: MCPServerTool,
    sessions: _Sessions,
    item: dict[str, Any],
    events: MCPEvents | None = None,
) -> None:
    """Run an `mcp_call` item's call on its MCP server (connected now if its tools were
    listed before): its `output`, or its `error` and status failed; with `events`, the item
    (opened as the model wrote the call) is closed."""
    item["status"] = "completed"
    try:
        if server.session is None:
            await _connect(server, sessions, list_tools=False)
        item["output"] = await server.session.call(item["name"], json.loads(item["arguments"]))
    except MCPToolError as exc:
        item["error"] = {
            "type": "mcp_tool_execution_error",
            "content": [{"type": "text", "text": str(exc)}],
        }
        item["status"] = "failed"
    except Exception as exc:  # the server went away, timed out, or broke the protocol
        sessions.pool.discard(server.session_key)  # the next call connects again
        server.session = None
        item["error"] = {"type": "mcp_protocol_error", "code": -32603, "message": str(exc)}
        item["status"] = "failed"
    if events is not None:
        await events.call_done(item)


def _call_items(call: dict[str, Any]) -> list[dict[str, Any]]:
    """The function call and output an `mcp_call` item stands for, for the model."""
    output = call.get("output")
    if output is None:
        error = call.get("error")
        if isinstance(error, dict):
            error = error.get("message") or " ".join(
                part.get("text", "") for part in error.get("content") or ()
            )
        output = f"error: {error}"
    return [
        {
            "type": "function_call",
            "call_id": call["id"],
            "name": call["name"],
            "arguments": call["arguments"],
        },
        {"type": "function_call_output", "call_id": call["id"], "output": output},
    ]


def _approval_request(server: MCPServerTool, call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item_id("mcpr"),
        "type": "mcp_approval_request",
        "server_label": server.label,
        "name": call["name"],
        "arguments": call["arguments"],
    }


def _add_usage(total: dict[str, Any] | None, usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage of several turns: every count summed (details too)."""
    if total is None or usage is None:
        return usage if total is None else total
    return {
        key: _add_usage(value, usage.get(key))
        if isinstance(value, dict)
        else value + usage.get(key, 0)
        for key, value in total.items()
    }


def _event_stream(
    response: _MCPResponse,
    inputs: list[dict[str, Any]],
    output: list[dict[str, Any]],
    pool: MCPSessionPool,
) -> EventSourceResponse:
    """The response's turns run in the stream's task, their events sent as they happen
    (agentrt.server.responses_mcp_stream); a client that goes away cancels them."""
    send, receive = anyio.create_memory_object_stream[ServerSentEvent]()  # unbuffered

    async def produce() -> None:
        async with send, AsyncExitStack() as stack:
            events = MCPEvents(send.send, response.id, response.fields())
            for item in output:
                await events.item(item)  # held until the first turn creates the response
            try:
                body = await response.run(inputs, list(output), _Sessions(pool, stack), events)
            except ClientDisconnected:
                raise  # nothing to tell anyone
            except Exception as exc:  # an APIError (a turn refused), the engine died...
                error = from_exception(exc)
                await events.fail(error.status, error.message, error.param, error.code)
                return
            await events.end(body)

    return EventSourceResponse(receive, data_sender_callable=produce, sep="\n")
