"""Real `agentrt serve` processes on localhost, driven by the official `openai` client.

`server` is the embedded SmolLM2 as `agentrt serve` runs it by default (the GGUF's own Q4_1
blocks), with a small KV cache and an API key, shared by the whole session; `tiny_server(...)`
starts a server on a tiny random checkpoint (fast to load and to run) with whatever options
a test needs: queue limits, drain, fuzzing.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.agentrt.server.helpers import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def server(smollm2_dir) -> Iterator[ServerProcess]:
    with ServerProcess(
        "--kv-cache-memory-gb",
        "0.25",
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        "1000000",
    ) as process:
        yield process


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http_client:
        yield http_client


@pytest.fixture(scope="session")
def model_name() -> str:
    return "SmolLM2-135M-Instruct"
