"""Responses kept on the server for `previous_response_id` and `GET /v1/responses/{id}`.

A stored response holds its body (what GET returns) and the conversation it ends: the chat
messages of every turn so far, its own output included, without the instructions (as in
OpenAI's API, instructions do not carry over to the next response). A continued
conversation shares the message dicts of the one it continues, so a long chain costs one
tuple of references per turn, not a copy of the history.

The store is bounded three ways, oldest first out: a number of responses, an age, and bytes
(each response counted with its whole conversation, a bound on what the store keeps alive,
however much is shared). It lives on the event loop: no locks.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_RESPONSES = 1024
MAX_AGE_S = 3600.0
MAX_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as JSON
    conversation: tuple[dict[str, Any], ...]  # chat messages after this response
    conversation_bytes: int  # JSON size of `conversation`
    stored_at: float  # time.monotonic()
    # The MCP servers whose tools the conversation has listed, by server_label (kept for
    # the next response, not returned by GET; agentrt.server.responses_mcp).
    mcp_listings: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        listings = len(json.dumps(self.mcp_listings)) if self.mcp_listings else 0
        return self.conversation_bytes + len(json.dumps(self.body)) + listings


class ResponseStore:
    """`put` / `get` / `delete` by response id. `get` never returns a response older than
    `max_age_s`; `put` evicts the oldest until every bound holds again."""

    def __init__(
        self,
        max_responses: int = MAX_RESPONSES,
        max_age_s: float = MAX_AGE_S,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        for name, value in (
            ("max_responses", max_responses),
            ("max_age_s", max_age_s),
            ("max_bytes", max_bytes),
        ):
            if value < 0:
                raise ValueError(f"ResponseStore {name}={value} is invalid: expected >= 0.")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._sizes: dict[str, int] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._responses)

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        conversation: Sequence[dict[str, Any]],
        *,
        continues: StoredResponse | None = None,
        mcp_listings: dict[str, Any] | None = None,
    ) -> None:
        """Store a response. `continues`: the stored response whose conversation
        `conversation` extends (its messages are counted from its size, not re-measured).
        A response larger than the whole budget is not stored."""
        conversation = tuple(conversation)
        if continues is not None and conversation[: len(continues.conversation)] == tuple(
            continues.conversation
        ):
            added = conversation[len(continues.conversation) :]
            num_bytes = continues.conversation_bytes + _json_size(added)
        else:
            num_bytes = _json_size(conversation)
        stored = StoredResponse(body, conversation, num_bytes, time.monotonic(), mcp_listings or {})
        size = stored.size
        if size > self.max_bytes:
            return
        self.delete(response_id)
        self._responses[response_id] = stored
        self._sizes[response_id] = size
        self.num_bytes += size
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        if self._responses.pop(response_id, None) is None:
            return False
        self.num_bytes -= self._sizes.pop(response_id)
        return True

    def _evict(self) -> None:
        deadline = time.monotonic() - self.max_age_s
        while self._responses:
            oldest_id, oldest = next(iter(self._responses.items()))
            over = len(self._responses) > self.max_responses or self.num_bytes > self.max_bytes
            if not over and oldest.stored_at >= deadline:
                return
            self.delete(oldest_id)


def _json_size(messages: Sequence[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
