"""An MCP server for the tests, written with the official SDK: `python mcp_testserver.py
stdio` serves on stdin/stdout, `python mcp_testserver.py http PORT` streamable HTTP on
127.0.0.1:PORT/mcp. Every tool call (and every HTTP request, before the SDK reads it) is
appended as one JSON line to the file named by $MCP_TEST_LOG, so a test can assert what
reached the server, or that nothing did."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("agentrt-test")


def log(event: dict) -> None:
    path = os.environ.get("MCP_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def warehouse_code_of(city: str) -> str:
    """What no model can guess: a code derived from the city's name."""
    return "WH-" + hashlib.sha256(city.strip().lower().encode()).hexdigest()[:6].upper()


@app.tool()
def warehouse_code(city: str) -> str:
    """The code of the company's warehouse in a city."""
    log({"tool": "warehouse_code", "arguments": {"city": city}})
    return f"The warehouse code for {city} is {warehouse_code_of(city)}."


@app.tool()
def broken_tool(reason: str) -> str:
    """A tool that always fails."""
    log({"tool": "broken_tool", "arguments": {"reason": reason}})
    raise ToolError(f"broken: {reason}")


def http_app():
    starlette = app.streamable_http_app()

    async def logged(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode() or None
            log({"http": scope["method"], "path": scope["path"], "authorization": authorization})
        await starlette(scope, receive, send)

    return logged


class HTTPServer:
    """`with HTTPServer(log) as server:` runs this server over streamable HTTP on a free
    port (`server.url`), logging to `log`, and stops it on exit."""

    def __init__(self, log: Path) -> None:
        from tests.agentrt.server.helpers import free_port

        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> HTTPServer:
        env = {**os.environ, "MCP_TEST_LOG": str(self.log)}
        argv = [sys.executable, __file__, "http", str(self.port)]
        self.process = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/", timeout=1)
                self.log.write_text("")  # the readiness probe is no client's request
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("the MCP test server did not start")

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)

    def requests(self) -> list[dict]:
        return read_log(self.log)


def read_log(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        app.run("stdio")
    else:
        import uvicorn

        uvicorn.run(http_app(), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
