"""MCP tools in the Agent (agentrt.mcp): a real MCP server written with the official SDK
(tests/agentrt/mcp_testserver.py), over stdio and streamable HTTP on localhost, its tools
called by the embedded model (greedy). The call must reach the server with the arguments the
model wrote, and the server's answer must come back as the tool message the model reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import agentrt
from agentrt.mcp import MCPToolError
from tests.agentrt.mcp_testserver import HTTPServer, read_log, warehouse_code_of

pytestmark = pytest.mark.anyio

SERVER = str(Path(__file__).with_name("mcp_testserver.py"))
SYSTEM = "You answer questions about the company. Use the tools, then answer in one sentence."
TASK = "What is the code of our warehouse in Oslo?"


def stdio_server(log: Path, **options) -> agentrt.mcp.MCPSession:
    return agentrt.mcp_server(
        [sys.executable, SERVER, "stdio"], env={"MCP_TEST_LOG": str(log)}, **options
    )


def _tool_calls(log: Path) -> list[dict]:
    return [event for event in read_log(log) if "tool" in event]


def _agent(rt, server) -> agentrt.Agent:
    return agentrt.Agent(
        rt, tools=[server], system=SYSTEM, max_steps=2, tool_choice="warehouse_code", max_tokens=48
    )


def _check_run(result: agentrt.AgentResult, log: Path) -> None:
    (call,) = result.steps[0].calls
    assert call.name == "warehouse_code"
    assert _tool_calls(log) == [{"tool": "warehouse_code", "arguments": call.arguments}]
    answer = f"The warehouse code for {call.arguments['city']} is "
    answer += f"{warehouse_code_of(call.arguments['city'])}."
    tool_message = next(m for m in result.messages if m["role"] == "tool")
    assert tool_message["content"] == answer
    assert tool_message["tool_call_id"] == call.id
    # The code is nowhere but in the tool's answer: the final answer read it there.
    assert warehouse_code_of(call.arguments["city"]) in result.output


async def test_agent_calls_a_stdio_mcp_server_and_answers_from_its_result(rt, tmp_path):
    log = tmp_path / "calls.jsonl"
    server = stdio_server(log)
    async with _agent(rt, server) as agent:
        result = await agent.run(TASK)
    _check_run(result, log)
    assert not server.is_open  # closed with the agent


async def test_agent_calls_a_streamable_http_mcp_server_with_its_headers(rt, tmp_path):
    log = tmp_path / "calls.jsonl"
    with HTTPServer(log) as http:
        server = agentrt.mcp_server(http.url, headers={"Authorization": "Bearer mcp-secret"})
        agent = _agent(rt, server)
        result = await agent.run(TASK)  # opens the session
        assert server.is_open
        await agent.close()
        assert not server.is_open
        _check_run(result, log)
        requests = [event for event in read_log(log) if "http" in event]
        assert requests and {r["authorization"] for r in requests} == {"Bearer mcp-secret"}


async def test_tools_are_listed_with_their_schemas_and_filtered(tmp_path):
    log = tmp_path / "calls.jsonl"
    async with stdio_server(log) as server:
        assert [t.name for t in server.tools] == ["warehouse_code", "broken_tool"]
        (lookup, broken) = server.tools
        assert lookup.description == "The code of the company's warehouse in a city."
        assert lookup.parameters["properties"]["city"]["type"] == "string"
        assert lookup.parameters["required"] == ["city"]
        assert await lookup.call({"city": "Lima"}) == (
            f"The warehouse code for Lima is {warehouse_code_of('Lima')}."
        )
        # A result the server marks as an error is raised (the Agent shows it to the model).
        with pytest.raises(MCPToolError, match="broken: no reason"):
            await broken.call({"reason": "no reason"})
    assert not server.is_open
    assert _tool_calls(log) == [
        {"tool": "warehouse_code", "arguments": {"city": "Lima"}},
        {"tool": "broken_tool", "arguments": {"reason": "no reason"}},
    ]
    async with stdio_server(log, allowed_tools=["broken_tool"]) as server:
        assert [t.name for t in server.tools] == ["broken_tool"]


async def test_an_unreachable_server_fails_the_agent_with_a_clear_error(rt, tmp_path):
    from tests.agentrt.server.helpers import free_port

    url = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    agent = agentrt.Agent(rt, tools=[agentrt.mcp_server(url)], max_steps=1)
    with pytest.raises(agentrt.MCPServerError, match="ConnectError"):
        await agent.run("Hello")
    with pytest.raises(agentrt.MCPServerError, match="ConnectError"):  # no half-open state
        await agent.run("Hello")


async def test_tool_names_stay_unique_across_sources(rt, tmp_path):
    @agentrt.tool
    def warehouse_code(city: str) -> str:
        """A local tool with an MCP tool's name."""
        return city

    agent = agentrt.Agent(rt, tools=[warehouse_code, stdio_server(tmp_path / "log")])
    with pytest.raises(agentrt.SchemaError, match="unique"):
        await agent.open()
    assert not agent._sources[0].is_open  # closed again


def test_a_target_is_a_url_or_a_command():
    with pytest.raises(agentrt.MCPServerError, match="empty"):
        agentrt.mcp_server("")
    with pytest.raises(agentrt.MCPServerError, match="No closing quotation"):
        agentrt.mcp_server("python 'server.py")
    with pytest.raises(agentrt.MCPServerError, match="headers"):
        agentrt.mcp_server("python server.py", headers={"A": "b"})
    with pytest.raises(agentrt.MCPServerError, match="env and cwd"):
        agentrt.mcp_server("http://127.0.0.1:1/mcp", env={"A": "b"})
