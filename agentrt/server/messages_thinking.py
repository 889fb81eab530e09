"""Signatures of the Messages API's thinking blocks, as Anthropic's API signs them.

A `thinking` block the server returns carries a `signature`: an HMAC-SHA256 over the served
model's name and the thinking text (base64), so a client can send the block back unchanged
in a later turn and the server can tell it made it. A block sent back whose signature does
not verify (edited text, another model's or another server's block, an empty signature) is
refused with a 400 `invalid_request_error`, as Anthropic's API refuses one ("Invalid
`signature` in `thinking` block"); a client drops thinking blocks it did not keep whole.

The key is derived from the instances' shared secret (`--kv-secret` / AGENTRT_KV_SECRET)
when there is one, so the decode instances behind `agentrt proxy` verify each other's
blocks; otherwise it is random per process, and a block signed before a restart is refused
after it. Thinking sent back is verified but, as before, not shown to the model again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

from agentrt.server.errors import bad_request
from agentrt.server.messages_protocol import MessageParam

_PURPOSE = b"agentrt messages thinking signature"


class ThinkingSigner:
    """Signs thinking text for one served model, and checks the blocks a request sends."""

    def __init__(self, key: bytes, model: str) -> None:
        self._key = key
        self._model = model.encode()

    @classmethod
    def for_server(cls, secret: str | None, model: str) -> ThinkingSigner:
        """The signer of a server with the shared `secret` (None: a key of its own)."""
        if secret is None:
            return cls(secrets.token_bytes(32), model)
        return cls(hmac.new(secret.encode(), _PURPOSE, hashlib.sha256).digest(), model)

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(len(self._model).to_bytes(8, "little") + self._model)
        mac.update(thinking.encode("utf-8", "surrogatepass"))
        return base64.b64encode(mac.digest()).decode()

    def verifies(self, thinking: object, signature: object) -> bool:
        if not isinstance(thinking, str) or not isinstance(signature, str):
            return False
        given = signature.encode("utf-8", "surrogatepass")
        return hmac.compare_digest(given, self.sign(thinking).encode())

    def check(self, messages: Sequence[MessageParam]) -> None:
        """Raise a 400 naming the first thinking block whose signature does not verify."""
        for index, message in enumerate(messages):
            if isinstance(message.content, str):
                continue
            for number, block in enumerate(message.content):
                if block.type != "thinking":
                    continue
                extra = block.model_extra or {}
                if not self.verifies(extra.get("thinking"), extra.get("signature")):
                    raise bad_request(
                        "Invalid `signature` in `thinking` block: send thinking blocks back "
                        "exactly as this server returned them (text and signature), or leave "
                        "them out.",
                        f"messages.{index}.content.{number}.signature",
                    )
