"""Responses `mcp` tools through a real `agentrt serve` with the official openai client: the
server lists an MCP server's tools (a real server written with the SDK,
tests/agentrt/mcp_testserver.py, over streamable HTTP and over stdio), the embedded model
(greedy) calls one, the server runs the call and the model answers from its result; approval
requests and responses as in OpenAI's API; a server_url outside --allow-mcp-servers is
refused before any connection."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.agentrt.mcp_testserver import HTTPServer, warehouse_code_of
from tests.agentrt.server.helpers import API_KEY, ServerProcess

STDIO_COMMAND = f"{sys.executable} {Path(__file__).parents[1] / 'mcp_testserver.py'} stdio"
QUESTION = "What is the code of our warehouse in Oslo?"
INSTRUCTIONS = "You answer questions about the company. Use the tools, then answer briefly."


@pytest.fixture(scope="module")
def mcp_http(tmp_path_factory) -> Iterator[HTTPServer]:
    with HTTPServer(tmp_path_factory.mktemp("mcp") / "requests.jsonl") as server:
        yield server


@pytest.fixture(scope="module")
def mcp_server_process(mcp_http: HTTPServer, smollm2_dir) -> Iterator[ServerProcess]:
    args = ("--kv-cache-memory-gb", "0.25", "--api-key", API_KEY)
    with ServerProcess(*args, "--allow-mcp-servers", mcp_http.url, STDIO_COMMAND) as process:
        yield process


@pytest.fixture(scope="module")
def mcp_client(mcp_server_process: ServerProcess) -> openai.OpenAI:
    url = mcp_server_process.url + "/v1"
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)


@pytest.fixture
def log(mcp_http: HTTPServer) -> HTTPServer:
    mcp_http.log.write_text("")
    return mcp_http


def _create(client: openai.OpenAI, **fields):
    """A greedy request (the Responses API samples at temperature 1 by default)."""
    return client.responses.create(model="SmolLM2-135M-Instruct", temperature=0, **fields)


def _tool(url: str, **fields) -> dict:
    return {"type": "mcp", "server_label": "company", "server_url": url, **fields}


def _calls(server: HTTPServer) -> list[dict]:
    return [event for event in server.requests() if "tool" in event]


def _check_call(call, server: HTTPServer | None = None) -> str:
    """The mcp_call item ran on the MCP server with the model's arguments: its code."""
    city = json.loads(call.arguments)["city"]
    assert call.name == "warehouse_code" and call.server_label == "company"
    assert call.error is None
    assert call.output == f"The warehouse code for {city} is {warehouse_code_of(city)}."
    if server is not None:
        assert _calls(server) == [{"tool": "warehouse_code", "arguments": {"city": city}}]
    return warehouse_code_of(city)


@pytest.mark.slow  # the module starts its own agentrt serve and MCP server processes
def test_the_server_runs_the_call_and_the_model_answers_from_it(mcp_client, log):
    response = _create(
        mcp_client,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        tools=[_tool(log.url, require_approval="never", authorization="mcp-token")],
        tool_choice={"type": "mcp", "server_label": "company", "name": "warehouse_code"},
        max_output_tokens=48,
    )
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "message"]
    listed = response.output[0]
    assert listed.server_label == "company"
    assert [t.name for t in listed.tools] == ["warehouse_code", "broken_tool"]
    assert listed.tools[0].input_schema["required"] == ["city"]
    code = _check_call(response.output[1], log)
    assert code in response.output_text  # the code is nowhere but in the call's output
    assert response.usage.output_tokens > 0
    assert response.tools[0].type == "mcp" and response.tools[0].server_url == log.url
    # The token went to the MCP server with every request, and is neither echoed nor stored.
    requests = [event for event in log.requests() if "http" in event]
    assert requests and {r["authorization"] for r in requests} == {"Bearer mcp-token"}
    assert "mcp-token" not in response.model_dump_json()
    assert "mcp-token" not in mcp_client.responses.retrieve(response.id).model_dump_json()


def test_a_call_waits_for_approval_and_runs_once_approved(mcp_client, log):
    tools = [_tool(log.url, allowed_tools=["warehouse_code"])]  # approval: "always" by default
    first = _create(
        mcp_client,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        tools=tools,
        tool_choice="required",
        max_output_tokens=48,
    )
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = first.output[1]
    assert request.name == "warehouse_code" and request.server_label == "company"
    assert [t.name for t in first.output[0].tools] == ["warehouse_code"]
    assert _calls(log) == []  # listed, never called
    second = _create(
        mcp_client,
        previous_response_id=first.id,
        input=[
            {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}
        ],
        tools=tools,
        max_output_tokens=48,
    )
    types = [item.type for item in second.output]
    # The conversation listed the server's tools already: not listed again (as OpenAI's API).
    assert types[0] == "mcp_call"
    call = second.output[0]
    assert call.approval_request_id == request.id and call.arguments == request.arguments
    _check_call(call, log)
    assert types[-1] == "message"  # the model went on from the call's output

    # Further on, a turn that calls nothing does not even contact the MCP server; with
    # other allowed_tools the server is listed again.
    log.log.write_text("")
    third = _create(
        mcp_client,
        previous_response_id=second.id,
        input="Thanks.",
        tools=tools,
        tool_choice="none",
        max_output_tokens=8,
    )
    assert [item.type for item in third.output] == ["message"]
    assert log.requests() == []
    fourth = _create(
        mcp_client,
        previous_response_id=third.id,
        input="Thanks again.",
        tools=[_tool(log.url, allowed_tools=["warehouse_code", "broken_tool"])],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert [item.type for item in fourth.output] == ["mcp_list_tools", "message"]
    assert {t.name for t in fourth.output[0].tools} == {"warehouse_code", "broken_tool"}


def test_a_declined_call_never_reaches_the_mcp_server(mcp_client, log):
    tools = [_tool(log.url, require_approval={"always": {"tool_names": ["warehouse_code"]}})]
    stream = _create(
        mcp_client,
        input=QUESTION,
        tools=tools,
        tool_choice="required",
        max_output_tokens=32,
        store=False,
        stream=True,
    )
    events = list(stream)
    first = events[-1].response
    request = first.output[-1]
    assert request.type == "mcp_approval_request"
    # Streamed, the request is an item of its own once the call's arguments are written.
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item for e in done] == first.output and done[-1].output_index == 1
    assert not any("arguments" in e.type for e in events)
    # store=False: the client sends the items back itself.
    items = [item.model_dump(exclude_none=True) for item in first.output]
    declined = {"type": "mcp_approval_response", "approval_request_id": request.id}
    second = _create(
        mcp_client,
        input=[{"role": "user", "content": QUESTION}, *items, {**declined, "approve": False}],
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
    )
    assert [item.type for item in second.output] == ["mcp_list_tools", "message"]
    assert _calls(log) == []


def _stdio_servers(parent: int) -> set[int]:
    """The pids of the stdio MCP test servers `parent` has started (and not yet stopped)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"mcp_testserver.py\0stdio" in cmdline:
            pids.add(int(stat.parent.name))
    return pids


def test_a_stdio_server_streamed(mcp_client, mcp_server_process):
    stream = _create(
        mcp_client,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        tools=[_tool(STDIO_COMMAND, require_approval="never")],
        tool_choice={"type": "mcp", "server_label": "company", "name": "warehouse_code"},
        max_output_tokens=48,
        stream=True,
    )
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[0].response.id == final.id and final.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["mcp_list_tools", "mcp_call", "message"]
    assert [item.id for item in done] == [item.id for item in final.output]
    code = _check_call(done[1])
    # The model's text streams as it is written (as a plain streamed response), after the
    # call it answers from has run; every event of an item carries its output index.
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert "".join(e.delta for e in deltas) == final.output_text and code in final.output_text
    kinds = [e.type for e in events]
    # The call's arguments stream as the model writes them, in OpenAI's order; the call runs
    # once they are done and the turn ended.
    call_at = [i for i, e in enumerate(events) if getattr(e, "output_index", None) == 1]
    call_kinds = [kinds[i] for i in call_at]
    num_deltas = call_kinds.count("response.mcp_call_arguments.delta")
    assert num_deltas > 1
    assert call_kinds == [
        "response.output_item.added",
        "response.mcp_call.in_progress",
        *["response.mcp_call_arguments.delta"] * num_deltas,
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
        "response.output_item.done",
    ]
    added, *_, arguments_done = (events[i] for i in call_at[: num_deltas + 3])
    assert added.item.type == "mcp_call" and added.item.arguments == ""
    assert {events[i].item_id for i in call_at[1:-1]} == {done[1].id}
    joined = "".join(events[i].delta for i in call_at[2 : 2 + num_deltas])
    assert joined == arguments_done.arguments == done[1].arguments
    assert call_at[-1] < kinds.index("response.output_text.delta")
    assert all(e.output_index == 2 for e in deltas)
    assert "response.function_call_arguments.delta" not in kinds  # MCP calls are mcp_call items

    # The command was started once and is kept for the next request (not started again).
    [started] = _stdio_servers(mcp_server_process.process.pid)
    again = _create(
        mcp_client,
        input=QUESTION,
        tools=[_tool(STDIO_COMMAND, require_approval="never")],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert [item.type for item in again.output] == ["mcp_list_tools", "message"]
    assert _stdio_servers(mcp_server_process.process.pid) == {started}


def test_a_url_outside_the_allow_list_is_refused_before_any_connection(mcp_client, log):
    # The same MCP server by another name: only the exact allow-listed URL may be used.
    alias = log.url.replace("127.0.0.1", "localhost")
    for url in (alias, "http://169.254.169.254/latest/meta-data", "python -m http.server"):
        with pytest.raises(openai.BadRequestError) as refused:
            _create(mcp_client, input=QUESTION, tools=[_tool(url)])
        assert refused.value.body["param"] == "tools.0.server_url"
        assert "nothing was contacted" in refused.value.body["message"]
    assert log.requests() == []  # no connection, not even a listing


def test_mcp_tools_are_off_without_an_allow_list(client):
    with pytest.raises(openai.BadRequestError, match="--allow-mcp-servers"):
        client.responses.create(input=QUESTION, tools=[_tool("http://127.0.0.1:1/mcp")])


def test_bad_mcp_tools_are_400s(mcp_client, log):
    bad = [
        ({"type": "mcp", "server_url": log.url}, "tools.0.server_label"),
        (_tool(log.url, require_approval="sometimes"), "tools.0.require_approval"),
        (_tool(STDIO_COMMAND, headers={"Authorization": "x"}), "tools.0.headers"),
    ]
    for tool, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            _create(mcp_client, input=QUESTION, tools=[tool])
        assert refused.value.body["param"] == param
    call = {"type": "mcp_call", "id": "mcp_1", "server_label": "company", "name": "x"}
    unknown = {"type": "mcp_approval_response", "approval_request_id": "mcpr_x", "approve": True}
    bad_items = [
        (unknown, "input.0.approval_request_id"),
        (call, "input.0"),  # no arguments
        ({**call, "arguments": "{}", "output": 7}, "input"),  # an output that is no text
    ]
    for item, param in bad_items:
        with pytest.raises(openai.BadRequestError) as refused:
            _create(mcp_client, input=[item], tools=[_tool(log.url)])
        assert refused.value.body["param"] == param
    assert _calls(log) == []
