"""The event stream of a Responses request with MCP tools (agentrt.server.responses_mcp),
sent as the response happens: OpenAI's event sequence, numbered once across its turns.

    response.created, response.in_progress   (the first turn's, as the response's)
    the items known before any turn: mcp_list_tools (output_item.added,
        mcp_list_tools.in_progress, .completed, output_item.done), an approved mcp_call
    each turn's own events as the model writes (reasoning, message text deltas, a client's
        function call), their output_index counted in the whole response; the turn's calls
        of MCP tools are not sent as function calls: each becomes an mcp_call item, sent as it
        runs (output_item.added, mcp_call_arguments.delta/.done, mcp_call.in_progress, then
        mcp_call.completed or .failed and output_item.done once the MCP server answered), or
        an mcp_approval_request item
    response.completed / response.incomplete (the whole response), or response.failed

A turn's lifecycle events (created, in_progress, completed) are not forwarded: its final
body is kept for the loop. An error before the response was created is an `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent


class MCPEvents:
    """Numbers and sends the events of one streamed MCP response (`emit`: an async callable
    taking a `ServerSentEvent`). `num_items`: the output items announced so far."""

    def __init__(self, emit, response_id: str, fields: dict[str, Any]) -> None:
        self.emit = emit
        self.response_id = response_id
        self.fields = fields  # what the response's body says whatever its turns say
        self.sequence_number = 0
        self.num_items = 0
        self.started = False
        self.pending: list[dict[str, Any]] = []  # items before the response was created

    async def send(self, event: dict[str, Any]) -> None:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        await self.emit(ServerSentEvent(json.dumps(event), event=event["type"]))

    def body(self, response: dict[str, Any]) -> dict[str, Any]:
        """A turn's response body as the MCP response's."""
        return {**response, "id": self.response_id, **self.fields}

    async def start(self, created: dict[str, Any]) -> None:
        """Send created and in_progress (the first turn's, as the response's), then the
        items found before it."""
        self.started = True
        start = {**self.body(created), "output": []}
        await self.send({"type": "response.created", "response": start})
        await self.send({"type": "response.in_progress", "response": start})
        pending, self.pending = self.pending, []
        for item in pending:
            await self.item(item)

    async def item(self, item: dict[str, Any]) -> None:
        """A whole item: mcp_list_tools, mcp_approval_request, or an mcp_call run already."""
        if not self.started:
            self.pending.append(item)
            return
        if item["type"] == "mcp_call":
            await self.call_started(item)
            await self.call_done(item)
            return
        where = {"output_index": self.num_items}
        added = {**item, "tools": []} if item["type"] == "mcp_list_tools" else item
        await self.send({"type": "response.output_item.added", **where, "item": added})
        if item["type"] == "mcp_list_tools":
            for stage in ("in_progress", "completed"):
                await self.send(
                    {"type": f"response.mcp_list_tools.{stage}", "item_id": item["id"], **where}
                )
        await self.send({"type": "response.output_item.done", **where, "item": item})
        self.num_items += 1

    async def call_started(self, call: dict[str, Any]) -> None:
        """An mcp_call about to run on its MCP server (its output not known yet)."""
        where = {"item_id": call["id"], "output_index": self.num_items}
        running = {**call, "output": None, "error": None, "status": "in_progress"}
        await self.send(
            {"type": "response.output_item.added", "output_index": self.num_items, "item": running}
        )
        arguments = call["arguments"]
        await self.send({"type": "response.mcp_call_arguments.delta", **where, "delta": arguments})
        await self.send(
            {"type": "response.mcp_call_arguments.done", **where, "arguments": arguments}
        )
        await self.send({"type": "response.mcp_call.in_progress", **where})

    async def call_done(self, call: dict[str, Any]) -> None:
        where = {"item_id": call["id"], "output_index": self.num_items}
        outcome = "failed" if call["status"] == "failed" else "completed"
        await self.send({"type": f"response.mcp_call.{outcome}", **where})
        await self.send(
            {"type": "response.output_item.done", "output_index": self.num_items, "item": call}
        )
        self.num_items += 1

    def turn(self, mcp_tools: set[str]) -> TurnEvents:
        return TurnEvents(self, mcp_tools)

    async def end(self, body: dict[str, Any]) -> None:
        done = {"completed": "response.completed", "incomplete": "response.incomplete"}
        await self.send({"type": done.get(body["status"], "response.failed"), "response": body})

    async def fail(self, status: int, message: str, param: str | None, code: Any) -> None:
        """The response could not be made: `response.failed` once it was created, else an
        `error` event."""
        if not self.started:
            await self.send(
                {"type": "error", "code": str(code), "message": message, "param": param}
            )
            return
        error = {"code": "server_error" if status >= 500 else "invalid_prompt", "message": message}
        failed = {**self.fields, "id": self.response_id, "object": "response"}
        failed |= {"status": "failed", "error": error, "output": []}
        await self.send({"type": "response.failed", "response": failed})


class TurnEvents:
    """The `emit` of one turn streamed through the Responses endpoint: its item events go on
    at the response's output indexes; its calls of MCP tools (`mcp_tools`) are held back (the
    loop sends them as mcp_call or mcp_approval_request items); its lifecycle events are
    kept: `final`, its last response body (`failed` when it failed)."""

    def __init__(self, events: MCPEvents, mcp_tools: set[str]) -> None:
        self.events = events
        self.mcp_tools = mcp_tools
        self.indexes: dict[int, int] = {}  # the turn's output index -> the response's
        self.held: set[int] = set()  # the turn's output indexes of MCP tool calls
        self.final: dict[str, Any] | None = None
        self.failed = False

    async def __call__(self, sse: ServerSentEvent) -> None:
        event = json.loads(sse.data)
        kind = event["type"]
        if kind == "response.created" and not self.events.started:
            await self.events.start(event["response"])
        if kind in ("response.created", "response.in_progress"):
            return
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.final, self.failed = event["response"], kind == "response.failed"
            return
        index = event.get("output_index")
        if index is None:
            await self.events.send(event)
            return
        if kind == "response.output_item.added":
            item = event["item"]
            if item["type"] == "function_call" and item["name"] in self.mcp_tools:
                self.held.add(index)
            else:
                self.indexes[index] = self.events.num_items
        if index in self.held:
            return
        event["output_index"] = self.indexes[index]
        await self.events.send(event)
        if kind == "response.output_item.done":
            self.events.num_items += 1
