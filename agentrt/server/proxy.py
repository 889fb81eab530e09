"""`agentrt proxy`: one OpenAI endpoint in front of disaggregated prefill and decode instances
of `agentrt serve` (after vLLM's disaggregated-prefill proxy).

A completion request (`/v1/chat/completions`, `/v1/completions`) goes upstream twice:

1. prefill: to a prefill instance (round-robin) with `max_tokens=1`, not streamed, and
   `kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` of its reply
   say where the prompt's KV cache waits. The proxy does not read them.
2. decode: the client's own body to a decode instance (round-robin) with those
   `kv_transfer_params` added; its reply (JSON, or an SSE stream) goes back to the client as
   is: status, content type, body, stream chunks as they arrive.

A prefill that fails (unreachable, past `prefill_timeout_s`, a 5xx) is logged and counted; the
decode instance then gets the request without `kv_transfer_params` and prefills it itself. A
4xx from the prefill instance is the client's fault: it goes back unchanged and nothing is
decoded. A decode instance that does not answer gives the client a 502 error object.

The proxy keeps no state of its own besides the round-robin turns and its counters, and
forwards only the `Authorization` header: the instances check API keys and validate bodies.
With `api_key` it checks the key itself before forwarding anything (401), as `agentrt serve`
does (the instances then take the same key); every body is limited to `max_request_bytes`
(413), the server's default; `/health` (open, for load balancers) names no upstream. A
client's own `kv_transfer_params` never pass: the field is the proxy's to set, and the decode
instance accepts only what a producer signed (engine/kv_transfer/auth.py).

Serving needs the `server` extra (fastapi, uvicorn, prometheus_client; httpx comes with
openai). `add_proxy_args` needs none of them, so the CLI builds its parser without them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    from agentrt.server.errors import APIError

logger = logging.getLogger("agentrt.proxy")

PREFILL_TIMEOUT_S = 60.0
MAX_REQUEST_BYTES = 8 * 2**20  # agentrt serve's default (ServerConfig.max_request_bytes)
DECODE_TIMEOUT_S = 600.0
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
# Why a prefill failed; the label of `agentrt_proxy_prefill_fallbacks_total`.
FALLBACK_REASONS = ("unreachable", "timeout", "server_error")
# Fields of the client's body the prefill request drops: a one-token, one-choice request must
# stay valid (`min_tokens` above 1 would exceed max_tokens=1, `best_of` would prefill n times).
PREFILL_DROPPED_FIELDS = ("max_completion_tokens", "min_tokens", "n", "best_of", "stream_options")
# Headers of the decode instance's reply kept besides the content type (a 429's back-off).
RELAYED_HEADERS = ("retry-after",)

_INSTALL_HINT = (
    "agentrt proxy needs fastapi, uvicorn and prometheus_client: pip install 'agentrt[server]'"
)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request for the client's `body`: one token, one choice, not
    streamed, asking to keep the KV cache for a remote decode. `body` is not modified."""
    request = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    request.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return request


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode instance's request: the client's `body` with the prefill's
    `kv_transfer_params` (none: the decode instance prefills itself). A client's own
    `kv_transfer_params` never passes: the field belongs to the proxy."""
    request = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    return request


@dataclass(slots=True)
class RoundRobin:
    """The URLs in turn. Used from one event loop, so no lock."""

    urls: tuple[str, ...]
    num_picked: int = 0

    def pick(self) -> str:
        url = self.urls[self.num_picked % len(self.urls)]
        self.num_picked += 1
        return url


@dataclass(slots=True, frozen=True)
class PrefillOutcome:
    """What the prefill step decided, one of three:

    - done: `fallback_reason` and `rejection` are None; `kv_transfer_params` is the prefill
      instance's (None when it returned none);
    - fallback: `fallback_reason` (one of FALLBACK_REASONS); decode without params;
    - rejected: `rejection` is the prefill instance's 4xx, for the client unchanged.
    """

    kv_transfer_params: dict[str, Any] | None = None
    fallback_reason: str | None = None
    rejection: Response | None = None


class ProxyMetrics:
    """The proxy's counters, in a registry of its own (two proxies in one process do not
    share counts). Every fallback reason is exported from the start, at 0."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "agentrt_proxy_requests",
            "Completion requests received.",
            registry=self.registry,
        )
        self.prefill_fallbacks = Counter(
            "agentrt_proxy_prefill_fallbacks",
            "Requests decoded without a remote prefill, by why the prefill failed.",
            ["reason"],
            registry=self.registry,
        )
        for reason in FALLBACK_REASONS:
            self.prefill_fallbacks.labels(reason)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class DisaggProxy:
    """The two upstream steps of a request, over one pooled HTTP client. `aclose()` closes
    the client (the app's lifespan does it)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        prefill_timeout_s: float,
        decode_timeout_s: float,
    ) -> None:
        import httpx

        self.prefill_instances = RoundRobin(_checked_urls("prefill", prefill_urls))
        self.decode_instances = RoundRobin(_checked_urls("decode", decode_urls))
        if prefill_timeout_s <= 0 or decode_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be positive seconds, got prefill {prefill_timeout_s}, "
                f"decode {decode_timeout_s}"
            )
        self.prefill_timeout_s = prefill_timeout_s
        self.metrics = ProxyMetrics()
        # No cap on connections: the instances have their own admission control (429), and
        # a cap here would queue requests behind long streams.
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(decode_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> PrefillOutcome:
        """Run the prefill step; never raises for an upstream failure and never waits longer
        than `prefill_timeout_s` (a whole-request deadline, not only per read)."""
        import anyio
        import httpx

        url = self.prefill_instances.pick() + path
        try:
            with anyio.fail_after(self.prefill_timeout_s):
                response = await self.http.post(
                    url, json=prefill_body(body), headers=headers, timeout=self.prefill_timeout_s
                )
        except (TimeoutError, httpx.TimeoutException):
            return self._fallback("timeout", url, f"no reply in {self.prefill_timeout_s}s")
        except httpx.TransportError as exc:
            return self._fallback("unreachable", url, repr(exc))
        if response.is_client_error:
            return PrefillOutcome(rejection=_relayed(response, response.content))
        if not response.is_success:
            return self._fallback("server_error", url, f"status {response.status_code}")
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return self._fallback("server_error", url, "the reply is not a JSON object")
        params = payload.get("kv_transfer_params")
        return PrefillOutcome(kv_transfer_params=params if isinstance(params, dict) else None)

    def _fallback(self, reason: str, url: str, why: str) -> PrefillOutcome:
        logger.warning(
            "prefill at %s failed (%s: %s); the decode instance prefills", url, reason, why
        )
        self.metrics.prefill_fallbacks.labels(reason).inc()
        return PrefillOutcome(fallback_reason=reason)

    async def forward(
        self, method: str, path: str, headers: dict[str, str], body: dict[str, Any] | None = None
    ) -> Response:
        """Send the request to a decode instance and relay its reply: an SSE reply streams
        through chunk by chunk, anything else is read whole. Raises `APIError` (502) when
        the instance does not answer."""
        import httpx
        from starlette.responses import StreamingResponse

        url = self.decode_instances.pick() + path
        request = self.http.build_request(method, url, json=body, headers=headers)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _bad_gateway(url, exc) from exc
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                _stream(response, url),
                status_code=response.status_code,
                headers=_relayed_headers(response),
            )
        try:
            content = await response.aread()
        except httpx.HTTPError as exc:
            raise _bad_gateway(url, exc) from exc
        finally:
            await response.aclose()
        return _relayed(response, content)


async def _stream(response: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The decode instance's SSE bytes as they arrive. A stream broken off upstream ends with
    an error event (the status line has gone out already); the upstream connection is closed
    however the stream ends, a client's disconnect included, so the instance aborts."""
    import httpx

    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        yield f"data: {json.dumps(_bad_gateway(url, exc).body())}\n\n".encode()
    finally:
        await response.aclose()


def _relayed_headers(response: httpx.Response) -> dict[str, str]:
    names = ("content-type", *RELAYED_HEADERS)
    return {name: response.headers[name] for name in names if name in response.headers}


def _relayed(response: httpx.Response, content: bytes) -> Response:
    from starlette.responses import Response

    return Response(content, status_code=response.status_code, headers=_relayed_headers(response))


def _bad_gateway(url: str, exc: Exception) -> APIError:
    from agentrt.server.errors import APIError

    logger.warning("the decode instance %s did not answer: %r", url, exc)
    return APIError(
        502,
        f"the decode instance {url} did not answer ({exc!r}); retry, or check that it runs",
        type="server_error",
        code="bad_gateway",
    )


def _checked_urls(role: str, urls: Sequence[str]) -> tuple[str, ...]:
    if not urls:
        raise ValueError(f"no {role} instance: give at least one URL (--{role} http://HOST:PORT)")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{role} URL {url!r} must start with http:// or https://")
    return tuple(url.rstrip("/") for url in urls)


def _forwarded_headers(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth is not None else {}


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
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The proxy's ASGI app. `api_key`: required as 'Authorization: Bearer KEY' on every
    route but /health. Raises ValueError for an empty URL list, a URL that is not http(s), a
    timeout that is not positive or a body limit below 1."""
    try:
        from contextlib import asynccontextmanager

        from fastapi import FastAPI
        from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
        from starlette.responses import JSONResponse, Response

        from agentrt.server.errors import install_error_handlers
        from agentrt.server.middleware import GuardMiddleware
    except ImportError as exc:  # pragma: no cover - the hint is the point
        raise ImportError(_INSTALL_HINT) from exc

    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")

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

    app = FastAPI(title="agentrt proxy", lifespan=lifespan)
    app.state.proxy = proxy
    install_error_handlers(app)

    # Starlette routes (the endpoint gets the request, nothing is injected): the proxy passes
    # bodies through and leaves their validation to the instances.
    async def complete(request: Request) -> Response:
        body = await _json_object(request)
        proxy.metrics.requests.inc()
        headers = _forwarded_headers(request)
        path = request.url.path
        outcome = await proxy.prefill(path, body, headers)
        if outcome.rejection is not None:
            return outcome.rejection
        return await proxy.forward(
            "POST", path, headers, decode_body(body, outcome.kv_transfer_params)
        )

    async def models(request: Request) -> Response:
        return await proxy.forward("GET", "/v1/models", _forwarded_headers(request))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})  # open to anyone: no upstream addresses

    async def metrics(request: Request) -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    for path in COMPLETION_PATHS:
        app.add_route(path, complete, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)
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
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AGENTRT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, checked before "
        "anything is forwarded (default: $AGENTRT_API_KEY; none = open)",
    )
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="else 413")
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
            max_request_bytes=args.max_request_bytes,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0
