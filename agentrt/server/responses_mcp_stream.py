"""The event stream of a Responses request with MCP tools (agentrt.server.responses_mcp),
sent as the response happens: OpenAI's event sequence, numbered once across its turns.

    response.created, response.in_progress   (the first turn's, as the response's)
    the items known before any turn: mcp_list_tools (output_item.added,
        mcp_list_tools.in_progress, .completed, output_item.done), an approved mcp_call
    each turn's own events as the model writes (reasoning, message text deltas, a client's
        function call), their output_index counted in the whole response; the turn's calls
        of MCP tools are not sent as function calls: each becomes an mcp_call item as the
        model writes it (output_item.added, mcp_call.in_progress, an mcp_call_arguments.delta
        for each function_call_arguments.delta, mcp_call_arguments.done), closed once the
        turn ended and the MCP server answered (mcp_call.completed or .failed, then
        output_item.done), or an mcp_approval_request item (whole, once its arguments are
        written)
    response.completed / response.incomplete (the whole response), or response.failed

A turn's lifecycle events (created, in_progress, completed) are not forwarded: its final
body is kept for the loop. An error before the response was created is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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
        self.open_calls: dict[str, int] = {}  # output index of each mcp_call not yet done

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
            await self.call_added(item)
            await self.call_arguments(item, item["arguments"])
            await self.call_arguments_done(item)
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

    async def call_added(self, call: dict[str, Any]) -> None:
        """Open an mcp_call item, its arguments still to come: it takes the next output
        index until `call_done`."""
        index = self.num_items
        self.open_calls[call["id"]] = index
        self.num_items += 1
        running = {**call, "arguments": "", "output": None, "error": None, "status": "in_progress"}
        await self.send(
            {"type": "response.output_item.added", "output_index": index, "item": running}
        )
        await self.send({"type": "response.mcp_call.in_progress", **self._where(call)})

    async def call_arguments(self, call: dict[str, Any], delta: str) -> None:
        where = self._where(call)
        await self.send({"type": "response.mcp_call_arguments.delta", **where, "delta": delta})

    async def call_arguments_done(self, call: dict[str, Any]) -> None:
        where, arguments = self._where(call), call["arguments"]
        await self.send(
            {"type": "response.mcp_call_arguments.done", **where, "arguments": arguments}
        )

    async def call_done(self, call: dict[str, Any]) -> None:
        """Close an open mcp_call item: the MCP server answered (`output`) or not (`error`)."""
        where = self._where(call)
        outcome = "failed" if call["status"] == "failed" else "completed"
        await self.send({"type": f"response.mcp_call.{outcome}", **where})
        index = self.open_calls.pop(call["id"])
        await self.send({"type": "response.output_item.done", "output_index": index, "item": call})

    def _where(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": call["id"], "output_index": self.open_calls[call["id"]]}

    def turn(self, mcp_item: Callable[[dict[str, Any]], dict[str, Any] | None]) -> TurnEvents:
        return TurnEvents(self, mcp_item)

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
    at the response's output indexes; a function call of an MCP tool goes on as the item
    `mcp_item(call)` gives for it (None for a client's tool): an mcp_call's events as the
    arguments are written (the loop closes it once the call ran), an mcp_approval_request
    whole once they are. Its lifecycle events are kept: `final`, its last response body
    (`failed` when it failed)."""

    def __init__(
        self, events: MCPEvents, mcp_item: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> None:
        self.events = events
        self.mcp_item = mcp_item
        self.indexes: dict[int, int] = {}  # the turn's output index -> the response's
        self.calls: dict[int, dict[str, Any]] = {}  # the turn's index -> an MCP call's item
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
            item = self.mcp_item(event["item"])
            if item is not None:
                self.calls[index] = item
            else:
                self.indexes[index] = self.events.num_items
        if index in self.calls:
            await self._call_event(self.calls[index], event)
            return
        event["output_index"] = self.indexes[index]
        await self.events.send(event)
        if kind == "response.output_item.done":
            self.events.num_items += 1

    async def _call_event(self, item: dict[str, Any], event: dict[str, Any]) -> None:
        """An event of a function call of an MCP tool, as its item's."""
        kind, run = event["type"], item["type"] == "mcp_call"
        if kind == "response.output_item.added" and run:
            await self.events.call_added(item)
        elif kind == "response.function_call_arguments.delta" and run:
            await self.events.call_arguments(item, event["delta"])
        elif kind == "response.function_call_arguments.done":
            item["arguments"] = event["arguments"]
            if run:
                await self.events.call_arguments_done(item)
            else:
                await self.events.item(item)
