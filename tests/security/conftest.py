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
    # No structured request first: the engine builds its grammar compiler (12-22 s on a
    # loaded 2-core machine) in the background from its start, and the first structured
    # request is itself an attack (test_hostile_requests.py's first test).
    victim = Victim(server.url, API_KEY)
    victim.measure_idle()
    return victim
