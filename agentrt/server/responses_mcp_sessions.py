"""MCP sessions kept open between Responses requests (agentrt.server.responses_mcp), so an
allow-listed stdio command is not started again for every request, nor an HTTP session
opened again.

A session is keyed by what makes it: (server_label, URL or command, allowed_tools, a SHA-256
of the headers), so a request never gets a session opened with another client's credential.
Each is opened and closed by a task of its own in the pool's task group (the MCP SDK's
sessions must be left in the task that entered them; requests only send calls on them). One
unused for `idle_s` is closed, at most `max_sessions` are kept (a new one closes the least
recently used idle one; with all of them busy a request opens one of its own, closed after
it), one whose call failed outside the tool is dropped, and `run` closes them all when the
server stops.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from agentrt.mcp import MCPSession

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

IDLE_S = 60.0
MAX_SESSIONS = 16

SessionKey = tuple[str, str, str, str]


def session_key(
    label: str, target: str, allowed_tools: list[str] | None, headers: dict[str, str]
) -> SessionKey:
    digest = hashlib.sha256(json.dumps(headers, sort_keys=True).encode()).hexdigest()
    return (label, target, json.dumps(allowed_tools), digest)


@dataclass(slots=True)
class _Entry:
    session: MCPSession
    close: anyio.Event = field(default_factory=anyio.Event)  # set: its task closes it
    num_users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class MCPSessionPool:
    """Open sessions by key (see the module docstring). `run` must be running (the app's
    lifespan starts it) for `session` to keep any; without it each use is its own."""

    def __init__(self, idle_s: float = IDLE_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._entries: dict[SessionKey, _Entry] = {}
        self._locks: dict[SessionKey, anyio.Lock] = {}
        self._tg: TaskGroup | None = None

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Own the sessions until cancelled, closing idle ones; then close them all."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                while True:
                    await anyio.sleep(max(self.idle_s / 4, 0.01))
                    deadline = time.monotonic() - self.idle_s
                    for key, entry in list(self._entries.items()):
                        if entry.num_users == 0 and entry.last_used < deadline:
                            self._drop(key)
                    for key in [k for k, lock in self._locks.items() if not lock.locked()]:
                        if key not in self._entries:
                            del self._locks[key]
        finally:
            self._tg = None
            for key in list(self._entries):
                self._drop(key)

    @asynccontextmanager
    async def session(
        self, key: SessionKey, new: MCPSession, *, list_tools: bool
    ) -> AsyncIterator[MCPSession]:
        """The open session of `key` (`new`, opened now, when there is none). Raises
        MCPServerError when it cannot be opened. `list_tools`: its tools are needed (a
        kept session lists them again)."""
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            entry = self._entries.get(key)
            if entry is not None and list_tools and not await _relisted(entry.session):
                self._drop(key)  # its server went away: open another
                entry = None
            if entry is None and self._tg is not None and self._make_room():
                entry = await self._open(key, new, list_tools)
            if entry is not None:
                entry.num_users += 1  # before any other task sweeps it
        if entry is None:  # not kept: this use's own
            try:
                await new.open(list_tools=list_tools)
                yield new
            finally:
                await new.close()
            return
        try:
            yield entry.session
        finally:
            entry.num_users -= 1
            entry.last_used = time.monotonic()

    def discard(self, key: SessionKey) -> None:
        """Close the session of `key` (its server failed us): the next use opens another."""
        self._drop(key)

    def _make_room(self) -> bool:
        if len(self._entries) < self.max_sessions:
            return True
        idle = [(e.last_used, k) for k, e in self._entries.items() if e.num_users == 0]
        if not idle:
            return False
        self._drop(min(idle)[1])
        return True

    async def _open(self, key: SessionKey, session: MCPSession, list_tools: bool) -> _Entry:
        entry = _Entry(session)
        opened = anyio.Event()
        failure: list[BaseException] = []

        async def own() -> None:
            try:
                await session.open(list_tools=list_tools)
            except Exception as exc:
                failure.append(exc)
                return
            finally:
                opened.set()
            try:
                await entry.close.wait()
            finally:  # in this task, which entered it (also when the pool stops)
                await session.close()

        self._tg.start_soon(own)
        await opened.wait()
        if failure:
            raise failure[0]
        entry.last_used = time.monotonic()
        self._entries[key] = entry
        return entry

    def _drop(self, key: SessionKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.close.set()


async def _relisted(session: MCPSession) -> bool:
    """List a kept session's tools again; False when its server no longer answers."""
    try:
        await session.list_tools()
    except Exception:  # noqa: BLE001 - any failure: the session is not usable
        return False
    return True
