"""What the server does when things go wrong around a request: the client leaves (its blocks
come back), the queue is full (429 + Retry-After), SIGTERM (drain, then exit 0), the engine
dies (/health 503, exit 1)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.llm import LLM
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import ServerProcess, in_process_server, metrics, wait_idle

MODEL = "SmolLM2-135M-Instruct"
# Far longer than the 10 s the tests give an aborted request to free its blocks: ~40 s on the
# default engine here (400 tokens took 5 s there, 33 s in fp32).
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_disconnect_mid_stream_frees_the_kv_blocks(http: httpx.Client):
    baseline = wait_idle(http)["agentrt:kv_cache_usage_perc"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json={**body, **LONG}) as response:
        assert response.status_code == 200
        events = _sse_events(response)
        for _ in range(4):
            json.loads(next(events))
        during = metrics(http)
        assert during["agentrt:num_requests_running"] == 1
        assert during["agentrt:kv_cache_usage_perc"] > baseline
    # Leaving the block closed the connection mid-stream: the request is aborted.
    started = time.monotonic()
    after = wait_idle(http, timeout_s=10)
    assert time.monotonic() - started < 10
    assert after["agentrt:kv_cache_usage_perc"] == baseline
    aborted = f'agentrt:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'
    assert after[aborted] >= 1


def test_disconnect_while_waiting_for_a_whole_reply_aborts_it(server, http: httpx.Client):
    baseline = wait_idle(http)["agentrt:kv_cache_usage_perc"]
    body = {"model": MODEL, "prompt": "Count to a thousand:", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.5)
    after = wait_idle(http, timeout_s=10)  # 3,000 tokens would take far longer
    assert after["agentrt:kv_cache_usage_perc"] == baseline


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def tiny_server(tiny_model: str) -> Iterator[ServerProcess]:
    """A tiny random model (about 170 tokens/s) that runs one request at a time and queues
    none; the drain test at the end of this module stops it."""
    args = ("--model", tiny_model, "--dtype", "float32", "--kv-cache-memory-gb", "0.05")
    limits = ("--max-num-seqs", "1", "--max-waiting-requests", "0", "--drain-timeout", "60")
    with ServerProcess(*args, *limits) as server:
        yield server


def test_full_queue_answers_429_with_retry_after(tiny_server: ServerProcess):
    server = tiny_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="llama",
        prompt="one",
        max_tokens=1500,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    next(iter(stream))  # it is running: the queue (1 running + 0 waiting) is full
    response = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": "two"})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="llama", prompt="three", max_tokens=2)
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # room again once the first one is aborted
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "llama", "prompt": "four", "max_tokens": 2},
        )
        if reply.status_code == 200:
            break
        time.sleep(0.05)
    assert reply.status_code == 200


def test_sigterm_drains_running_requests_then_exits_0(tiny_server: ServerProcess):
    server = tiny_server
    body = {"model": "llama", "prompt": "x", "max_tokens": 500, "ignore_eos": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = _sse_events(response)
        next(events)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "draining" in health.text
        refused = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2})
        assert refused.status_code == 503
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=30) == 0


@pytest.mark.anyio
async def test_dead_engine_makes_health_503_and_exits_1(tiny_model: str):
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory_gb=0.01)
    original_step = llm.engine.engine_core.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault")
        return original_step()

    llm.engine.engine_core.step = failing_step
    config = ServerConfig(engine_args=EngineArgs(model=tiny_model), dead_engine_grace_s=3.0)
    async with in_process_server(config, llm.engine) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            body = {"model": "llama", "prompt": "x", "max_tokens": 50, "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 503
            assert "injected fault" in response.json()["error"]["message"]
            health = await http.get("/health")
            assert health.status_code == 503 and "engine dead" in health.text
            assert health.json()["error"]["code"] == "engine_unavailable"  # ErrorCode.ENGINE_DEAD
    assert server.exit_code == 1
