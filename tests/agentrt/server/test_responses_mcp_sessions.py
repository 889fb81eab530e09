"""MCPSessionPool on the real stdio MCP test server (tests/agentrt/mcp_testserver.py): a
session is opened once for its key and reused, a key with other headers or tools gets its
own, an idle one is closed, the cap closes the least recently used idle one, a failed one
is replaced, and stopping the pool closes them all."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest

from agentrt.mcp import mcp_server
from agentrt.server.responses_mcp_sessions import MCPSessionPool, session_key

pytestmark = pytest.mark.slow  # real stdio MCP server processes, a few seconds each

COMMAND = f"{sys.executable} {Path(__file__).parents[1] / 'mcp_testserver.py'} stdio"


def key(label: str = "company", tools: list[str] | None = None, token: str = "") -> tuple:
    return session_key(label, COMMAND, tools, {"Authorization": token} if token else {})


async def use(pool: MCPSessionPool, k: tuple, *, list_tools: bool = True):
    """One request's use of the pool: the session it got, and a call made on it."""
    async with pool.session(k, mcp_server(COMMAND), list_tools=list_tools) as session:
        text = await session.call("warehouse_code", {"city": "Oslo"})
        assert text.startswith("The warehouse code for Oslo is WH-")
        return session


def test_sessions_are_kept_per_key_capped_replaced_and_closed_on_stop():
    async def main() -> None:
        pool = MCPSessionPool(max_sessions=2)
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            first = await use(pool, key())
            assert first.is_open and [t.name for t in first.tools][0] == "warehouse_code"
            assert await use(pool, key(), list_tools=False) is first  # not started again
            other = await use(pool, key(token="another client's"))
            assert other is not first and len(pool) == 2
            # The cap: a third key closes the least recently used idle session (first).
            third = await use(pool, key(label="other"))
            assert not first.is_open and other.is_open and third.is_open
            # A session whose server failed us is replaced.
            pool.discard(key(label="other"))
            await anyio.sleep(0.05)
            assert not third.is_open and await use(pool, key(label="other")) is not third
            tg.cancel_scope.cancel()
        assert not other.is_open and len(pool) == 0  # stopping the pool closed them

    anyio.run(main)


def test_an_idle_session_is_closed():
    async def main() -> None:
        pool = MCPSessionPool(idle_s=0.2)
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            session = await use(pool, key())
            with anyio.fail_after(5):
                while session.is_open:
                    await anyio.sleep(0.05)
            assert len(pool) == 0
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_without_a_running_pool_each_use_has_its_own_session():
    async def main() -> None:
        pool = MCPSessionPool()
        session = await use(pool, key())
        assert not session.is_open and len(pool) == 0

    anyio.run(main)


def test_a_server_that_cannot_start_is_not_kept():
    from agentrt.errors import MCPServerError

    async def main() -> None:
        pool = MCPSessionPool()
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)
            broken = mcp_server(f"{sys.executable} -c 'import sys; sys.exit(3)'")
            with pytest.raises(MCPServerError):
                async with pool.session(key(label="broken"), broken, list_tools=True):
                    pass
            assert len(pool) == 0
            tg.cancel_scope.cancel()

    anyio.run(main)
