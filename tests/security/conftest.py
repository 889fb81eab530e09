"""A real `agentrt serve` on the embedded model (real sockets on 127.0.0.1), shared by the
adversarial suite, and the victim that measures what a hostile request does to others."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.agentrt.server.helpers import API_KEY, ServerProcess
from tests.security.victim import Victim


@pytest.fixture(scope="session")
def server(smollm2_dir) -> Iterator[ServerProcess]:
    # The defaults a deployment gets (8 MiB bodies, no client priority), a key, a small cache.
    with ServerProcess("--kv-cache-memory-gb", "0.25", "--api-key", API_KEY) as process:
        yield process


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def victim(server: ServerProcess, http: httpx.Client) -> Victim:
    # The engine builds its grammar compiler (tokenizer analysis, 12-22 s on this machine) on
    # its own thread at the first structured request, stalling everyone once per process
    # (engine/core/structured_output.py, reported on issue #42): paid here, not measured.
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "x",
        "max_tokens": 2,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    assert http.post("/v1/completions", json=body).status_code == 200
    victim = Victim(server.url, API_KEY)
    victim.measure_idle()
    return victim
