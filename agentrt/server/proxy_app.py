"""`agentrt proxy`'s HTTP side: the ASGI app (completion routes through `DisaggProxy`, the
other routes forwarded to a decode instance, /health, /metrics, the API-key and body-size
guard) and its command line.

Serving needs the `server` extra (fastapi, uvicorn, prometheus_client; httpx comes with
openai). `add_proxy_args` needs none of them, so the CLI builds its parser without them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentrt.server.batch_options import MAX_FILE_BYTES
from agentrt.server.cli import add_listen_args
from agentrt.server.proxy import DECODE_TIMEOUT_S, PREFILL_TIMEOUT_S, DisaggProxy, decode_body

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from starlette.responses import Response

MAX_REQUEST_BYTES = 8 * 2**20  # agentrt serve's default (ServerConfig.max_request_bytes)
MULTIPART_SLACK = 64 * 1024  # an upload's multipart fields beside the file (app.py's)
# Prefilled on a prefill instance, decoded on a decode instance.
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# Stateless: forwarded to a decode instance in turn.
FORWARDED_PATHS = ("/v1/messages/count_tokens",)
# What an instance keeps (stored responses for previous_response_id, files, batches): always
# forwarded to the first decode instance, so a later request finds it. Not prefilled
# elsewhere (a Responses request takes no kv_transfer_params, and may be several turns).
HOME_ROUTES = (
    ("/v1/responses", ("POST",)),
    ("/v1/responses/{id}", ("GET", "DELETE")),
    ("/v1/files", ("GET", "POST")),
    ("/v1/files/{id}", ("GET", "DELETE")),
    ("/v1/files/{id}/content", ("GET",)),
    ("/v1/batches", ("GET", "POST")),
    ("/v1/batches/{id}", ("GET",)),
    ("/v1/batches/{id}/cancel", ("POST",)),
)
_INSTALL_HINT = (
    "agentrt proxy needs fastapi, uvicorn and prometheus_client: pip install 'agentrt[server]'"
)


def upstream_headers(upstream_api_key: str | None) -> dict[str, str]:
    """The headers every upstream request carries: the proxy's own credential, never the
    client's (a client's key is for the proxy; forwarded, the instances would answer any
    key the client guessed, and one client's key would reach the instances as its own)."""
    return {"authorization": f"Bearer {upstream_api_key}"} if upstream_api_key else {}


def checked_body(path: str, body: dict[str, Any]) -> None:
    """Refuse (400) a body the decode instance would refuse, before the prefill instance
    holds KV blocks for it: a decode that fails leaves them pinned until the hold times out."""
    import pydantic

    from agentrt.engine.errors import InvalidRequestError
    from agentrt.server.errors import bad_request, from_exception
    from agentrt.server.messages_api import chat_request
    from agentrt.server.messages_protocol import MessagesRequest
    from agentrt.server.params import choice_params
    from agentrt.server.protocol import ChatCompletionRequest, CompletionRequest

    models = {"/v1/chat/completions": ChatCompletionRequest, "/v1/messages": MessagesRequest}
    try:
        request = models.get(path, CompletionRequest).model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise bad_request(f"{param}: {first.get('msg')}", param=param) from None
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
    if isinstance(request, MessagesRequest):  # served as the chat request it means
        request = chat_request(request, request.model)
    try:
        choice_params(
            request.model_copy(update={"kv_transfer_params": None}),
            max_tokens=max_tokens,
            max_tokens_field="max_tokens",
            logprobs=None,
            structured=None,
        )
    except InvalidRequestError as exc:
        raise from_exception(exc) from None


async def _json_object(request: Request) -> dict[str, Any]:
    from agentrt.server.errors import bad_request

    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def create_proxy_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    prefill_timeout_s: float = PREFILL_TIMEOUT_S,
    decode_timeout_s: float = DECODE_TIMEOUT_S,
    api_key: str | None = None,
    upstream_api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> FastAPI:
    """The proxy's ASGI app. `api_key`: required as 'Authorization: Bearer KEY' on every
    route but /health. `upstream_api_key`: what the proxy sends the instances (default: its
    own `api_key`; never a client's header). `max_file_bytes`: the largest upload to
    /v1/files (agentrt serve's default). Raises ValueError for an empty URL list, a URL that
    is not http(s), a timeout that is not positive or a body limit below 1."""
    try:
        from contextlib import asynccontextmanager

        from fastapi import FastAPI
        from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
        from starlette.responses import JSONResponse, Response

        from agentrt.server.errors import install_error_handlers
        from agentrt.server.middleware import GuardMiddleware
    except ImportError as exc:  # pragma: no cover - the hint is the point
        raise ImportError(_INSTALL_HINT) from exc

    for name, limit in (
        ("max_request_bytes", max_request_bytes),
        ("max_file_bytes", max_file_bytes),
    ):
        if limit < 1:
            raise ValueError(f"{name} must be at least 1, got {limit}")

    proxy = DisaggProxy(
        prefill_urls,
        decode_urls,
        prefill_timeout_s=prefill_timeout_s,
        decode_timeout_s=decode_timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.aclose()

    headers = upstream_headers(upstream_api_key or api_key)
    app = FastAPI(title="agentrt proxy", lifespan=lifespan)
    app.state.proxy = proxy
    install_error_handlers(app)

    # Starlette routes (the endpoint gets the request, nothing is injected): the proxy passes
    # bodies through and leaves their validation to the instances.
    async def complete(request: Request) -> Response:
        body = await _json_object(request)
        proxy.metrics.requests.inc()
        path = request.url.path
        checked_body(path, body)
        outcome = await proxy.prefill(path, body, headers)
        if outcome.rejection is not None:
            return outcome.rejection
        return await proxy.forward(
            "POST", path, headers, decode_body(body, outcome.kv_transfer_params)
        )

    async def forwarded(request: Request) -> Response:
        return await proxy.forward("POST", request.url.path, headers, await _json_object(request))

    async def at_home(request: Request) -> Response:
        """A stateful route's request, to the first decode instance as the client sent it
        (a multipart upload keeps its content type), but with the proxy's credential."""
        sent = dict(headers)
        if "content-type" in request.headers:
            sent["content-type"] = request.headers["content-type"]
        return await proxy.forward(
            request.method,
            request.url.path,
            sent,
            content=await request.body(),
            query=request.url.query,
            home=True,
        )

    async def models(request: Request) -> Response:
        return await proxy.forward("GET", "/v1/models", headers)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})  # open to anyone: no upstream addresses

    async def metrics(request: Request) -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    for path in COMPLETION_PATHS:
        app.add_route(path, complete, methods=["POST"])
    for path in FORWARDED_PATHS:
        app.add_route(path, forwarded, methods=["POST"])
    for path, methods in HOME_ROUTES:
        app.add_route(path, at_home, methods=list(methods))
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        max_upload_bytes={"/v1/files": max_file_bytes + MULTIPART_SLACK},
    )
    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill instance, e.g. http://127.0.0.1:8100 (repeat for several: round-robin)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode instance (repeat for several: round-robin)",
    )
    add_listen_args(parser, ", checked before anything is forwarded")
    parser.add_argument(
        "--upstream-api-key",
        default=os.environ.get("AGENTRT_UPSTREAM_API_KEY"),
        help="the key the proxy sends the instances (default: $AGENTRT_UPSTREAM_API_KEY, else "
        "--api-key); a client's own key is never forwarded",
    )
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="else 413")
    parser.add_argument(
        "--max-file-bytes", type=int, default=MAX_FILE_BYTES, help="the largest /v1/files upload"
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=PREFILL_TIMEOUT_S,
        help="seconds a prefill may take before the decode instance prefills instead",
    )
    parser.add_argument(
        "--decode-timeout",
        type=float,
        default=DECODE_TIMEOUT_S,
        help="seconds the decode instance may stay silent (connect, or between chunks)",
    )
    parser.add_argument("--log-level", default="info")


def run_proxy(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; 2 for invalid options. The proxy holds no requests of
    its own to drain: uvicorn's stop (finish open responses, then re-raise the signal) is
    enough."""
    import sys

    try:
        import uvicorn
    except ImportError:  # pragma: no cover - the hint is the point
        raise ImportError(_INSTALL_HINT) from None

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app = create_proxy_app(
            args.prefill,
            args.decode,
            prefill_timeout_s=args.prefill_timeout,
            decode_timeout_s=args.decode_timeout,
            api_key=args.api_key or None,
            upstream_api_key=args.upstream_api_key or None,
            max_request_bytes=args.max_request_bytes,
            max_file_bytes=args.max_file_bytes,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0
