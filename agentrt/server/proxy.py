"""`agentrt proxy`: one OpenAI endpoint in front of disaggregated prefill and decode instances
of `agentrt serve` (after vLLM's disaggregated-prefill proxy).

A completion request (`/v1/chat/completions`, `/v1/completions`) goes upstream twice:

1. prefill: to a prefill instance (round-robin) with `max_tokens=1`, not streamed, and
   `kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` of its reply
   say where the prompt's KV cache waits. The proxy does not read them.
2. decode: the client's own body to a decode instance (round-robin) with those
   `kv_transfer_params` added; its reply (JSON, or an SSE stream) goes back to the client as
   is: status, content type, body, stream chunks as they arrive.

A prefill that fails (unreachable, past `prefill_timeout_s`, a 5xx, a 429: a producer that
holds all the KV it may) is logged and counted; the decode instance then gets the request
without `kv_transfer_params` and prefills it itself. Any other 4xx from the prefill instance
is the client's fault: it goes back unchanged and nothing is decoded. The body is checked
first (`proxy_app.checked_body`), so a body the decode instance would refuse never makes a
prefill instance hold blocks for it. A decode instance that does not answer gives the client a 502 error object.

The proxy keeps no state of its own besides the round-robin turns and its counters. Upstream
it sends its own credential (`upstream_api_key`, default its `api_key`), never a client's
header. With `api_key` it checks the client's key itself before forwarding anything (401), as
`agentrt serve` does; every body is limited to `max_request_bytes`
(413), the server's default; `/health` (open, for load balancers) names no upstream. A
client's own `kv_transfer_params` never pass: the field is the proxy's to set, and the decode
instance accepts only what a producer signed (engine/kv_transfer/auth.py).

This module is what goes upstream and how replies come back (`DisaggProxy`); the ASGI app,
its routes and the command line are `proxy_app.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx
    from starlette.responses import Response

    from agentrt.server.errors import APIError

logger = logging.getLogger("agentrt.proxy")

PREFILL_TIMEOUT_S = 60.0
DECODE_TIMEOUT_S = 600.0
# Why a prefill failed; the label of `agentrt_proxy_prefill_fallbacks_total`.
FALLBACK_REASONS = ("unreachable", "timeout", "server_error", "overloaded")
# Fields of the client's body the prefill request drops: a one-token, one-choice request must
# stay valid (`min_tokens` above 1 would exceed max_tokens=1, `best_of` would prefill n times).
PREFILL_DROPPED_FIELDS = ("max_completion_tokens", "min_tokens", "n", "best_of", "stream_options")
# Headers of the decode instance's reply kept besides the content type (a 429's back-off).
RELAYED_HEADERS = ("retry-after",)


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
        if response.status_code == 429:
            # The producer holds all the KV it may for consumers (or its queue is full): the
            # client's request is fine, and the decode instance can prefill it itself.
            return self._fallback("overloaded", url, "429: the prefill instance is busy")
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
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: dict[str, Any] | None = None,
        *,
        content: bytes | None = None,
        query: str = "",
        home: bool = False,
    ) -> Response:
        """Send the request to a decode instance and relay its reply: a reply that is not
        JSON (an SSE stream, a file's bytes) streams through chunk by chunk, JSON is read
        whole. `body` goes as JSON, `content` as is (with the content type in `headers`).
        `home`: to the first decode instance, whatever the round-robin's turn (the one that
        keeps stored responses, files and batches). Raises `APIError` (502) when the
        instance does not answer."""
        import httpx
        from starlette.responses import StreamingResponse

        base = self.decode_instances.urls[0] if home else self.decode_instances.pick()
        url = base + path + (f"?{query}" if query else "")
        request = self.http.build_request(method, url, json=body, content=content, headers=headers)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _bad_gateway(url, exc) from exc
        if not response.headers.get("content-type", "").startswith("application/json"):
            return StreamingResponse(
                _stream(response, url, path),
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


async def _stream(response: httpx.Response, url: str, path: str) -> AsyncIterator[bytes]:
    """The decode instance's bytes as they arrive. An SSE stream broken off upstream ends with
    an error event (the status line has gone out already; Anthropic's `event: error` under
    its routes), other bytes just end; the upstream connection is closed however the stream
    ends, a client's disconnect included, so the instance aborts."""
    import httpx

    from agentrt.server.errors import anthropic_shaped

    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        error = _bad_gateway(url, exc)  # logged; a file's bytes just end short
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            if anthropic_shaped(path):
                yield f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n".encode()
            else:
                yield f"data: {json.dumps(error.body())}\n\n".encode()
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
