"""MCP tools: `agentrt.mcp_server(...)` is one MCP server's tools as a tool source for an
`Agent` (and for the server's Responses `type: "mcp"` tools), over the official `mcp` SDK.

    async with Agent(rt, tools=[lookup, agentrt.mcp_server("http://127.0.0.1:9000/mcp")]) as agent:
        result = await agent.run("...")

A target is a streamable HTTP URL (`http://` or `https://`) or a command that speaks MCP on
its stdin/stdout (a string split as a shell would, or an argv list). `open()` connects, lists
the server's tools (every page) and returns them as `Tool`s whose `parameters` are the
server's input schemas, so each call's arguments are grammar-exact as for any `@tool`;
calling one sends `tools/call` and returns its text. A result the server marks as an error
raises `MCPToolError` (the Agent shows it to the model as it shows a Python tool's
exception). `close()` ends the session (and stops a stdio server's process).

The session's context managers are entered and left by `open()` and `close()`: call both
from the same task (`async with`, or `Agent.run` then `Agent.close` in one coroutine), as
anyio's task groups require.
"""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

from agentrt.errors import MCPServerError
from agentrt.tools import Tool

DEFAULT_TIMEOUT_S = 60.0
MAX_TOOL_PAGES = 100  # a server whose listing never ends cannot hang open()


class MCPToolError(Exception):
    """An MCP server answered a tool call with `isError`; the message is its text."""


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def command_argv(target: str | Sequence[str]) -> list[str]:
    """The argv of a stdio server's command (a string is split as a shell would)."""
    try:
        argv = shlex.split(target) if isinstance(target, str) else list(target)
    except ValueError as exc:  # unbalanced quotes
        raise MCPServerError(f"MCP server command {target!r}: {exc}") from None
    if not argv:
        raise MCPServerError("an MCP server command is empty: give a URL or a command to run.")
    return argv


def mcp_server(
    target: str | Sequence[str],
    *,
    headers: dict[str, str] | None = None,
    allowed_tools: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> MCPSession:
    """One MCP server's tools, for `Agent(tools=[...])`. `target`: a streamable HTTP URL, or
    the command of a stdio server. `headers` go with every HTTP request (e.g.
    Authorization); `env` and `cwd` are the stdio process's. `allowed_tools`: offer only
    these of the server's tools (None: all). `timeout_s` bounds each request's answer."""
    if isinstance(target, str) and is_url(target):
        if env is not None or cwd is not None:
            raise MCPServerError("env and cwd are a stdio server's: this target is a URL.")
    elif headers:
        raise MCPServerError("headers are an HTTP server's: this target is a command.")
    else:
        command_argv(target)
    return MCPSession(target, headers, allowed_tools, env, cwd, timeout_s)


class MCPSession:
    """The connection to one MCP server (see the module docstring). Not shared between
    tasks that open and close it; `open()` and `close()` may be called again (no-ops)."""

    def __init__(
        self,
        target: str | Sequence[str],
        headers: dict[str, str] | None,
        allowed_tools: Sequence[str] | None,
        env: dict[str, str] | None,
        cwd: str | None,
        timeout_s: float | None,
    ) -> None:
        self.target = target
        self.headers = dict(headers or {})
        self.allowed_tools = None if allowed_tools is None else frozenset(allowed_tools)
        self.env = env
        self.cwd = cwd
        self.timeout_s = timeout_s
        self.tools: list[Tool] = []  # once open
        self._client: Any = None
        self._stack: AsyncExitStack | None = None

    def __repr__(self) -> str:
        return f"mcp_server({self.target!r})"

    @property
    def is_open(self) -> bool:
        return self._client is not None

    async def __aenter__(self) -> MCPSession:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self, *, list_tools: bool = True) -> list[Tool]:
        """Connect, list the server's tools and return them (the allowed ones; none without
        `list_tools`: a caller that knows them already). Raises MCPServerError when the
        server cannot be reached or fails to answer."""
        if self._stack is not None:
            return self.tools
        stack = AsyncExitStack()
        try:
            self._client = await _connect(self, stack)
            if list_tools:
                await self.list_tools()
        except BaseException as exc:
            await stack.aclose()
            self._client = None
            if isinstance(exc, Exception):
                raise MCPServerError(f"MCP server {self.target!r}: {_reason(exc)}") from exc
            raise
        self._stack = stack
        return self.tools

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """`tools/call`: the text of the result (its structured content as JSON when it
        has no text). Raises MCPToolError for a result marked as an error."""
        if self._client is None:
            raise MCPServerError(f"{self!r} is not open: open() it (or the Agent) first.")
        result = await self._client.call_tool(name, arguments)
        text = result_text(result)
        if result.is_error:
            raise MCPToolError(text or f"tool {name!r} failed")
        return text

    async def list_tools(self) -> list[Tool]:
        """List the server's (allowed) tools again on the open session, and return them."""
        self.tools = [self._tool(t) for t in await self._list_tools()]
        return self.tools

    async def _list_tools(self) -> list[Any]:
        tools, cursor = [], None
        for _ in range(MAX_TOOL_PAGES):
            page = await self._client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return [t for t in tools if self.allowed_tools is None or t.name in self.allowed_tools]

    def _tool(self, listed: Any) -> Tool:
        schema = dict(listed.input_schema or {"type": "object"})
        schema.pop("title", None)
        fn = functools.partial(self.call, listed.name)
        return Tool(listed.name, (listed.description or "").strip(), schema, fn, None)


def result_text(result: Any) -> str:
    """What a `CallToolResult` says, as one text: its text parts, one per line (other
    parts named by their type), or its structured content as JSON."""
    parts = []
    for part in result.content:
        if part.type == "text":
            parts.append(part.text)
        else:
            parts.append(f"[{part.type} {getattr(part, 'mime_type', None) or ''}]".strip())
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


async def _connect(session: MCPSession, stack: AsyncExitStack) -> Any:
    """An `mcp.Client` connected to the session's server, entered on `stack` (with the HTTP
    client that carries the session's headers, closed after it)."""
    try:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters
    except ImportError:  # pragma: no cover - the hint is the point
        raise ImportError("MCP tools need the mcp SDK: pip install 'agentrt[mcp]'") from None
    target = session.target
    if isinstance(target, str) and is_url(target):
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        http = await stack.enter_async_context(create_mcp_http_client(headers=session.headers))
        server = streamable_http_client(target, http_client=http)
    else:
        argv = command_argv(target)
        server = StdioServerParameters(
            command=argv[0], args=argv[1:], env=session.env, cwd=session.cwd
        )
    client = Client(server, read_timeout_seconds=session.timeout_s)
    return await stack.enter_async_context(client)


def _reason(exc: BaseException) -> str:
    """The first leaf of an exception group (the SDK's task groups wrap what failed)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
