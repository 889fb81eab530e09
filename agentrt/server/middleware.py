"""The guard in front of every route: the API key (401) and the body size limit (413).

It is plain ASGI, not `BaseHTTPMiddleware`, so streamed responses pass through untouched.
The body is read in full here (up to the limit) and replayed to the app: an oversized body
is refused before any route parses it, whether it came with a Content-Length or chunked.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from agentrt.server.errors import APIError

# Routes that answer without the API key (load balancers probe them).
OPEN_PATHS = frozenset({"/health"})


class GuardMiddleware:
    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_request_bytes: int,
        on_status: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.on_status = on_status

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.on_status is not None:
            send = _observed(send, self.on_status)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not self._authorized(headers.get("authorization", "")):
                await _send_error(send, _unauthorized())
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            await _send_error(send, self._too_large())
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                await _send_error(send, self._too_large())
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than {self.max_request_bytes} bytes; send a smaller "
            "request (or start the server with a larger --max-request-bytes).",
            code="request_too_large",
        )


def _unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key the "
        "server was started with (--api-key).",
        code="invalid_api_key",
    )


def _observed(send, on_status: Callable[[int], None]):
    async def observed(message) -> None:
        if message["type"] == "http.response.start":
            on_status(message["status"])
        await send(message)

    return observed


def _replay(body: bytes, receive):
    """A `receive` that yields the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
