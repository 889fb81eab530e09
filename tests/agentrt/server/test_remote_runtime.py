"""The remote Runtime (`Runtime(base_url=..., api_key=...)`, the official openai client)
against a real `agentrt serve` process passes the same Session and Agent tests as the local
Runtime: the tests are imported from tests/agentrt and run here with a remote `rt`."""

from __future__ import annotations

import http.server
import threading

import pytest
from pydantic import BaseModel

import agentrt
from agentrt import InvalidRequestError, SchemaError
from agentrt.backend import Completion
from agentrt.formats import resolve_format, tools_format
from agentrt.remote import RemoteBackend
from tests.agentrt.server.helpers import API_KEY
from tests.agentrt.test_agent import (  # noqa: F401 (collected here with the remote rt)
    test_forced_tool_call_runs_and_the_run_ends_typed,
)
from tests.agentrt.test_session import (  # noqa: F401 (collected here with the remote rt)
    test_cancelled_generate_frees_its_blocks,
    test_fork_shares_the_prefix_and_diverges,
    test_post_validation_failure_and_explicit_retries,
    test_schema_errors_are_typed_and_name_the_problem,
    test_schema_kinds_round_trip,
    test_stream_partial_objects_are_prefixes_of_the_final_object,
    test_stream_text_deltas_concatenate_to_the_reply,
    test_truncated_output_carries_the_partial_text,
    test_turns_hit_the_prefix_cache_and_history_grows,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def rt(server):
    async with agentrt.Runtime(base_url=server.url + "/v1", api_key=API_KEY) as runtime:
        yield runtime


class Person(BaseModel):
    name: str
    age: int


def test_requests_speak_openai():
    backend = RemoteBackend(base_url="http://127.0.0.1:1/v1", model="m")
    sampling = {"temperature": 0.0, "max_tokens": 9, "top_k": 5, "stop": "x", "logit_bias": {3: 1}}
    request = backend.request([], resolve_format(Person), sampling)
    assert request["response_format"]["type"] == "json_schema"
    assert request["response_format"]["json_schema"]["strict"] is True
    assert request["response_format"]["json_schema"]["schema"]["required"] == ["name", "age"]
    assert request["extra_body"] == {"top_k": 5}  # non-OpenAI options only when set
    assert request["stop"] == ["x"] and request["logit_bias"] == {"3": 1}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = backend.request([], tools_format(tools, "f", parallel_tool_calls=False), {})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert named["parallel_tool_calls"] is False
    regex = backend.request([], resolve_format(agentrt.Regex("[a-z]+")), {})
    assert regex["extra_body"] == {"structured_outputs": {"regex": "[a-z]+"}}


async def test_tool_calls_come_back_as_the_local_payload(rt, smollm2_default_llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                },
            },
        }
    ]
    # One call (parallel off) whose only argument is at most 20 characters: it ends well
    # inside the budget, so the reply must finish and parse, and greedy decoding makes
    # it the same call the local backend on the same engine produces.
    fmt = tools_format(tools, "required", parallel_tool_calls=False)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    sampling = {"max_tokens": 120, "temperature": 0.0}
    items = [i async for i in rt.backend.stream(messages, fmt, sampling)]
    completion = items[-1]
    assert isinstance(completion, Completion)
    assert completion.finish_reason == "stop", completion
    calls = fmt.parse(completion.text)
    assert [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].arguments["city"], str)
    assert 0 < len(calls[0].arguments["city"]) <= 20
    assert completion.usage.completion_tokens > 0
    async with agentrt.Runtime(engine=smollm2_default_llm.engine) as local:
        items = [i async for i in local.backend.stream(messages, fmt, sampling)]
    local_calls = fmt.parse(items[-1].text)
    assert [(c.name, c.arguments) for c in local_calls] == [(c.name, c.arguments) for c in calls]


async def test_reasoning_with_named_markers_travels(rt):
    """SmolLM2 has no reasoning markers: `reasoning_parser` names them and reasoning=True
    forces the block on the server too (the local test: tests/agentrt/test_reasoning.py);
    the reasoning comes back apart, bounded by max_reasoning_tokens."""
    session = rt.session(system="You extract facts as JSON.")
    person = await session.generate(
        "John Smith is 42.",
        schema=Person,
        reasoning=True,
        reasoning_parser="qwen3",
        max_reasoning_tokens=12,
    )
    last = session.last
    assert last.reasoning and "</think>" not in last.reasoning
    assert Person.model_validate_json(last.text) == person
    # 12 tokens of text and the two markers, spelled in SmolLM2's ordinary tokens.
    assert 12 < last.usage.reasoning_tokens <= 12 + 2 * 6
    assert last.usage.completion_tokens > last.usage.reasoning_tokens


async def test_remote_errors_are_typed(server):
    async with agentrt.Runtime(base_url=server.url + "/v1", api_key="wrong") as rt:
        with pytest.raises(InvalidRequestError, match="API key"):
            await rt.generate("hi", max_tokens=2)
    async with agentrt.Runtime(
        model="no-such-model", base_url=server.url + "/v1", api_key=API_KEY
    ) as rt:
        with pytest.raises(InvalidRequestError, match="does not exist") as info:
            await rt.generate("hi", max_tokens=2)
        assert info.value.field == "model"
    async with agentrt.Runtime(base_url=server.url + "/v1", api_key=API_KEY) as rt:
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await rt.generate("hi", max_tokens=10**7)
        with pytest.raises(SchemaError):
            await rt.generate("hi", schema={"type": "object", "properties": {"a": {"$ref": "#/x"}}})
        stats = await rt.stats()
        assert stats.num_waiting == 0 and 0.0 <= stats.kv_cache_usage <= 1.0


METRICS_TEXT = """\
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:num_preemptions Preemptions.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:num_preemptions_total{engine="1",model_name="m"} 6.0
# HELP vllm:prefix_cache_queries Queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
# HELP vllm:prefix_cache_hits Hit tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0
# HELP vllm:e2e_request_latency_seconds Latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 2.5
vllm:e2e_request_latency_seconds_count{model_name="m"} 4.0
"""


async def test_stats_add_up_every_series_of_a_metric():
    """A server with several engines (vLLM data parallel) exports one series per engine:
    counts add up, the KV usage fraction is their mean."""

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            body = METRICS_TEXT.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        backend = RemoteBackend(base_url=f"http://127.0.0.1:{httpd.server_port}/v1", model="m")
        stats = await backend.stats()
        await backend.aclose()
    finally:
        httpd.shutdown()
        thread.join()
    assert stats.num_running == 5 and stats.num_waiting == 5
    assert stats.kv_cache_usage == 0.5
    assert stats.num_preemptions == 11
    assert stats.prefix_cache_queried_tokens == 150 and stats.prefix_cache_hit_tokens == 50
