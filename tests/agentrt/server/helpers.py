"""Start and stop `agentrt serve` subprocesses; read their Prometheus metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(*serve_args) as server:` runs `python -m agentrt serve` (or another
    `command` that serves HTTP, e.g. "proxy") on a free port and waits for /health; on exit
    it sends SIGTERM and waits for the process. Its output goes to a log file in the temp
    folder, removed when the block ends without an exception; otherwise kept and its path
    printed (pytest shows it with the failure)."""

    def __init__(self, *args: str, command: str = "serve") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "agentrt", command, "--port", str(self.port), *args]
        self.log = Path(tempfile.mkstemp(prefix="agentrt-serve-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENTRT_NUM_THREADS": "1"}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"agentrt serve exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.process.kill()
        raise RuntimeError(f"agentrt serve did not start:\n{self.output()}")

    def __exit__(self, exc_type, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if exc_type is None:
            self.log.unlink(missing_ok=True)
        else:
            print(f"the server's log is kept: {self.log}", file=sys.stderr)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics as `name{labels}` -> value (labels sorted by name) and `name` -> the sum of
    its series, read with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(http: httpx.Client, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; returns the idle metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(http)
        idle = values["agentrt:num_requests_running"] == 0
        if idle and values["agentrt:num_requests_waiting"] == 0:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle after {timeout_s}s: {values}")
        time.sleep(0.05)


@asynccontextmanager
async def in_process_server(config, llm_engine) -> AsyncIterator[InProcessServer]:
    """`serve(config, llm_engine=...)` as a task of the test's event loop on a free port;
    waits for /health. Leaving the block waits for the server to stop: by itself (a dead
    engine) or after `server.stop()` (a drain, as on SIGTERM)."""
    from agentrt.server.serve import serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = InProcessServer(f"http://127.0.0.1:{sock.getsockname()[1]}")

    async def run() -> None:
        server.exit_code = await serve(
            config, llm_engine=llm_engine, sock=sock, log_level="warning", on_ready=server.ready
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(30):
            async with httpx.AsyncClient() as http:
                while server.exit_code is None:
                    try:
                        if (await http.get(server.url + "/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await anyio.sleep(0.05)
        yield server


class InProcessServer:
    def __init__(self, url: str) -> None:
        self.url = url
        self.exit_code: int | None = None
        self.state = None

    def ready(self, state) -> None:
        self.state = state

    def stop(self) -> None:
        """Drain and exit, as on SIGTERM."""
        self.state.drain_requested = True
