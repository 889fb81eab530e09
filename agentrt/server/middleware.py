"""The guard in front of every route: the API key (401) and the body size limit (413).

The key comes as `Authorization: Bearer KEY` (OpenAI's clients) or, without that header, as
`x-api-key: KEY` (Anthropic's); `request_api_key` reads it for both the check and the
per-key cache isolation (ServerState.cache_salt).

It is plain ASGI, not `BaseHTTPMiddleware`, so streamed responses pass through untouched.
The body is read in full here (up to the limit) and replayed to the app: an oversized body
is refused before any route parses it, whether it came with a Content-Length or chunked.
Routes that stream their own body (`streamed_paths`) are the exception: a Content-Length
past their limit is refused here, but their body is not buffered (it would hold a whole
file in memory): the route reads it as it comes and enforces its caps as it reads
(agentrt serve's `/v1/files`: agentrt.server.file_upload).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Collection, Mapping

from agentrt.server.errors import APIError, anthropic_shaped

# Routes that answer without the API key (load balancers probe them).
OPEN_PATHS = frozenset({"/health"})


class GuardMiddleware:
    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_request_bytes: int,
        max_upload_bytes: Mapping[str, int] | None = None,
        streamed_paths: Collection[str] = (),
        on_status: Callable[[int], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_upload_bytes = dict(max_upload_bytes or {})  # path -> its own body limit
        self.streamed_paths = frozenset(streamed_paths)  # their routes cap what they read
        self.on_status = on_status

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.on_status is not None:
            send = _observed(send, self.on_status)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not self._authorized(headers):
                await _send_error(send, _unauthorized(), scope["path"])
                return
        limit = self.max_upload_bytes.get(scope["path"], self.max_request_bytes)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, self._too_large(limit), scope["path"])
            return
        if scope["path"] in self.streamed_paths:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _send_error(send, self._too_large(limit), scope["path"])
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        token = request_api_key(headers)
        return token is not None and hmac.compare_digest(token.encode(), self.api_key.encode())

    def _too_large(self, limit: int) -> APIError:
        flag = "--max-request-bytes" if limit == self.max_request_bytes else "--max-file-bytes"
        return APIError(
            413,
            f"the request body is larger than {limit} bytes; send a smaller "
            f"request (or start the server with a larger {flag}).",
            code="request_too_large",
        )


def request_api_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request sent (`headers` with lower-case names): the bearer token of
    its `Authorization` header when it has one, else its `x-api-key`; None: neither."""
    header = headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    key = headers.get("x-api-key")
    return key.strip() if key is not None else None


def _unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: "
        "<key>') with the key the server was started with (--api-key).",
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


async def _send_error(send, error: APIError, path: str) -> None:
    shaped = error.anthropic_body() if anthropic_shaped(path) else error.body()
    body = json.dumps(shaped).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
