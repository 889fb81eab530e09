"""What one client may not do to another, or reach on the server (issue #42), on a tiny model
served in-process: template variables beyond the allow-list, another tenant's prefix-cache
hits (cache_salt, --cache-isolation), queue priority, paths and reprs in responses, prompt
work on the event loop."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.llm import LLM
from agentrt.server import offload
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import in_process_server

# A prompt of several full KV blocks, so a second identical request would hit the cache.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.02)


def _config(llm: LLM, **server) -> ServerConfig:
    return ServerConfig(engine_args=EngineArgs(model="llama"), **server)


async def _cached(http: httpx.AsyncClient, **extra) -> int:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 1, **extra}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.anyio
async def test_cache_salt_keeps_prefix_hits_within_one_salt(tiny_llm: LLM) -> None:
    tiny_llm.engine.reset_prefix_cache()
    async with in_process_server(_config(tiny_llm), tiny_llm.engine) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            assert await _cached(http, cache_salt="tenant-a") == 0
            assert await _cached(http, cache_salt="tenant-b") == 0  # used to be a full hit
            assert await _cached(http) == 0  # unsalted: its own cache
            assert await _cached(http, cache_salt="tenant-a") > 0
            chat = {
                "model": "llama",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 1,
                "cache_salt": "",
            }
            response = await http.post("/v1/chat/completions", json=chat)
            assert response.status_code == 400 and "cache_salt" in response.text
            chat["cache_salt"] = "tenant-c"
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            responses = {"model": "llama", "input": PROMPT, "cache_salt": "tenant-d"}
            assert (await http.post("/v1/responses", json=responses)).status_code == 200
            server.stop()


@pytest.mark.anyio
async def test_cache_isolation_by_user_derives_a_salt_per_user(tiny_llm: LLM) -> None:
    tiny_llm.engine.reset_prefix_cache()
    config = _config(tiny_llm, cache_isolation="user")
    async with in_process_server(config, tiny_llm.engine) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            assert await _cached(http, user="alice") == 0
            assert await _cached(http, user="bob") == 0
            assert await _cached(http, user="bob", cache_salt="alice") == 0  # no forging
            assert await _cached(http, user="alice") > 0
            server.stop()


@pytest.mark.anyio
async def test_client_priority_is_ignored_unless_allowed(tiny_llm: LLM) -> None:
    seen: list[int] = []
    original = tiny_llm.engine.add_request

    def spy(request, prompt):
        seen.append(request.priority)
        return original(request, prompt)

    tiny_llm.engine.add_request = spy
    try:
        for allow, expected in ((False, 0), (True, -5)):
            config = _config(tiny_llm, allow_client_priority=allow)
            async with in_process_server(config, tiny_llm.engine) as server:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    body = {"model": "llama", "prompt": "x", "max_tokens": 1, "priority": -5}
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
                    server.stop()
            assert seen[-1] == expected
    finally:
        del tiny_llm.engine.add_request


@pytest.mark.anyio
async def test_template_kwargs_are_allow_listed(tiny_llm: LLM) -> None:
    async with in_process_server(_config(tiny_llm), tiny_llm.engine) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
            injected = "{{ raise_exception('INJECTED') }}"
            for kwargs in ({"chat_template": injected}, {"tokenize": True}):
                reply = await http.post(
                    "/v1/chat/completions",
                    json={**body, "max_tokens": 1, "chat_template_kwargs": kwargs},
                )
                assert reply.status_code == 400, reply.text
                assert "INJECTED" not in reply.text
                assert "not a template variable" in reply.json()["error"]["message"]
            allowed = {**body, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}}
            assert (await http.post("/v1/chat/completions", json=allowed)).status_code == 200
            server.stop()


@pytest.mark.anyio
async def test_no_paths_or_reprs_in_responses(tiny_llm: LLM, tiny_checkpoint) -> None:
    original = tiny_llm.engine.add_request

    def broken(*args, **kwargs):
        raise RuntimeError(f"secret detail {tiny_checkpoint('llama')}")

    async with in_process_server(_config(tiny_llm), tiny_llm.engine) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            models = (await http.get("/v1/models")).text
            assert str(tiny_checkpoint("llama")) not in models and "/" not in models
            tiny_llm.engine.add_request = broken
            try:
                body = {"model": "llama", "prompt": "x", "max_tokens": 1}
                reply = await http.post("/v1/completions", json=body)
            finally:
                del tiny_llm.engine.add_request
            assert reply.status_code == 500
            assert "secret detail" not in reply.text and "RuntimeError" not in reply.text
            assert "internal error" in reply.json()["error"]["message"]
            server.stop()
    assert original == tiny_llm.engine.add_request


@pytest.mark.anyio
async def test_prompt_work_runs_off_the_loop_within_a_time_limit(
    tiny_llm: LLM, monkeypatch
) -> None:
    # A template that loops for ever used to freeze every request, /health included.
    monkeypatch.setattr(offload, "MAX_PROMPT_SECONDS", 1.0)
    tokenizer = tiny_llm.engine.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    try:
        async with in_process_server(_config(tiny_llm), tiny_llm.engine) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
                health: list[float] = []

                async def poll() -> None:
                    for _ in range(10):
                        start = time.monotonic()
                        assert (await http.get("/health")).status_code == 200
                        health.append(time.monotonic() - start)
                        await anyio.sleep(0.1)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(poll)
                    start = time.monotonic()
                    reply = await http.post("/v1/chat/completions", json=body)
                    took = time.monotonic() - start
                assert reply.status_code == 400 and "longer than" in reply.text
                assert took < 5.0
                assert max(health) < 0.5, health
                server.stop()
    finally:
        tokenizer.chat_template = saved


def test_isolation_by_key_derives_one_salt_per_api_key() -> None:
    from agentrt.server.state import ServerState

    state = ServerState(ServerConfig(cache_isolation="key"), engine=None)
    alice = {"authorization": "Bearer key-of-alice"}
    bob = {"authorization": "Bearer key-of-bob"}
    assert state.cache_salt(None, None, alice) == state.cache_salt(None, "anyone", alice)
    assert state.cache_salt(None, None, alice) != state.cache_salt(None, None, bob)
    # A client's own salt splits its tenant further, and cannot name another tenant's.
    own = state.cache_salt("project-1", None, alice)
    assert own != state.cache_salt(None, None, alice)
    assert state.cache_salt(state.cache_salt(None, None, alice), None, bob) not in (
        own,
        state.cache_salt(None, None, alice),
    )
    assert ServerState(ServerConfig(), engine=None).cache_salt("s", "u", alice) == "s"
