"""The server on an engine process (`agentrt serve --engine-process`): requests run through
the core process, and a core killed with SIGKILL makes /health answer 503 and the server
exit 1, with the pending request failed instead of hanging."""

from __future__ import annotations

import os
import signal

import anyio
import httpx
import pytest

from agentrt.engine.args import EngineArgs
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import in_process_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.slow
async def test_a_killed_core_makes_health_503_and_the_server_exit_1(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    args = EngineArgs(model=model, dtype="float32", kv_cache_memory_gb=0.05, engine_process=True)
    config = ServerConfig(engine_args=args, dead_engine_grace_s=5.0)
    async with in_process_server(config, None) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            body = {"model": "llama", "prompt": "x", "max_tokens": 5, "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 5
            assert (await http.get("/health")).status_code == 200
            card = (await http.get("/v1/models")).json()["data"][0]
            assert card["root"] == card["id"] == "llama"  # the name, never the path

            long = {**body, "max_tokens": 1500}
            replies: list[httpx.Response] = []

            async def pending() -> None:
                replies.append(await http.post("/v1/completions", json=long))

            async with anyio.create_task_group() as tg:
                tg.start_soon(pending)
                with anyio.fail_after(30):
                    while (await server.state.engine.stats()).num_running == 0:
                        await anyio.sleep(0.02)
                os.kill(server.state.engine.client.processes[0].pid, signal.SIGKILL)
                with anyio.fail_after(5):
                    while (health := await http.get("/health")).status_code == 200:
                        await anyio.sleep(0.05)
            assert health.status_code == 503 and "engine dead" in health.text
            assert replies[0].status_code == 503
            assert replies[0].json()["error"]["code"] == "engine_unavailable"
    assert server.exit_code == 1
