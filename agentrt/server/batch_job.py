"""The lines of one batch, run through the server's own routes: shared by `/v1/batches` and
`agentrt run-batch`.

Input lines (OpenAI's batch format): `{"custom_id", "method": "POST", "url", "body"}`, `url`
one of `ENDPOINTS`. `validate` checks a whole file before anything runs; `iter_lines`
then streams it (the file is never held in memory).

Each line runs on the app's own route (`AppDispatcher`): its body is validated into the
route's request model and the route's endpoint is called with it, in-process and without
HTTP (a POST through httpx.ASGITransport and the middleware cost the event loop 0.50 ms of
CPU a line, this 0.04 ms), so a batch line gets what an HTTP client would: the same
validation errors, the same handler, errors shaped by the app's own exception handlers,
counted in its metrics.
Not repeated per line: the API-key guard (a batch runs only under its owner's key, the
server's: agentrt.server.batches; the key is still in the line's headers, for
--cache-isolation key) and the body-size guard (the line comes from a stored file capped by
--max-file-bytes; an over-long prompt is still refused by the context-length check). Its
result is one output line:
`{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`.

Resuming is `agentrt extract`'s (agentrt.extract_io): results go to a JSONL journal appended
and flushed line by line; on start the journal is scanned, a torn last line cut off, and the
custom_ids it holds are not run again. A line that the server could not run at all (503:
draining, or the engine died) is not written, so it runs again on resume.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from agentrt.extract_io import OutputState, scan_jsonl

ENDPOINTS = ("/v1/chat/completions", "/v1/responses")
MAX_REPORTED_ERRORS = 100
RETRY_AFTER_S = 1.0  # after a 429 (the queue is full of other clients' requests)


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    """One bad input line, as OpenAI reports it in a failed batch's `errors`."""

    line: int | None  # None: not about one line
    message: str
    code: str = "invalid_request"
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


class ServerUnavailable(Exception):
    """The server answered 503 (draining, or its engine died): the batch stops, unfinished."""


def parse_line(number: int, raw: bytes, endpoint: str | None) -> BatchLine | LineError:
    """Line `number` of an input file. `endpoint`: the url every line must have (a batch's),
    or None: any of `ENDPOINTS` (run-batch)."""
    try:
        item = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return LineError(number, f"line {number} is not JSON: {exc}")
    if not isinstance(item, dict):
        return LineError(number, f"line {number} is not a JSON object.")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            number, f"line {number}: custom_id must be a non-empty string.", param="custom_id"
        )
    if item.get("method", "POST") != "POST":
        return LineError(number, f"line {number}: method must be POST.", param="method")
    allowed = ENDPOINTS if endpoint is None else (endpoint,)
    if url not in allowed:
        return LineError(
            number, f"line {number}: url {url!r} is not one of {list(allowed)}.", param="url"
        )
    if not isinstance(body, dict):
        return LineError(number, f"line {number}: body must be a JSON object.", param="body")
    if body.get("stream"):
        return LineError(number, f"line {number}: a batch line cannot stream.", param="body.stream")
    return BatchLine(custom_id, url, body)


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def validate(path: Path, endpoint: str | None) -> tuple[int, list[LineError]]:
    """The number of requests in `path`, and its bad lines (the first
    `MAX_REPORTED_ERRORS`): unparsable, wrong url, a repeated custom_id, none at all."""
    seen: set[str] = set()
    num_lines, errors = 0, []
    for number, raw in _numbered_lines(path):
        num_lines += 1
        line = parse_line(number, raw, endpoint)
        if isinstance(line, BatchLine) and line.custom_id in seen:
            line = LineError(
                number,
                f"line {number}: custom_id {line.custom_id!r} is repeated.",
                "duplicate_custom_id",
                "custom_id",
            )
        if isinstance(line, LineError):
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(line)
            continue
        seen.add(line.custom_id)
    if num_lines == 0:
        errors.append(LineError(None, "the input file has no requests.", "empty_file"))
    return num_lines, errors


def iter_lines(path: Path, endpoint: str | None, done: set[str]) -> Iterator[BatchLine]:
    """The valid lines of a validated file whose custom_id is not in `done`."""
    for number, raw in _numbered_lines(path):
        line = parse_line(number, raw, endpoint)
        if isinstance(line, BatchLine) and line.custom_id not in done:
            yield line


def load_journal(path: Path) -> OutputState:
    """The custom_ids already answered in a journal (a torn last line cut off), and the
    failed ones among them (`state.failed`)."""
    state = OutputState(key="custom_id")
    if path.exists():
        scan_jsonl(path, state, repair=True)
    return state


def succeeded(record: dict[str, Any]) -> bool:
    """Whether an output record is a 2xx (else it goes to a batch's error file)."""
    response = record.get("response")
    return response is not None and 200 <= response["status_code"] < 300


class AppDispatcher:
    """Runs lines on the POST routes of `ENDPOINTS` of a FastAPI app (started: its lifespan
    entered), in-process: the body validated as FastAPI validates it, the route's endpoint
    awaited, an exception answered by the app's exception handler for it (as Starlette
    picks it), the status counted in the server's metrics. `api_key`: the batch owner's,
    sent in the request's headers (the endpoints read it for --cache-isolation key)."""

    def __init__(self, app: FastAPI, api_key: str | None) -> None:
        self._app = app
        self._routes = {url: _post_route(app, url) for url in ENDPOINTS}
        self._headers = (
            [] if api_key is None else [(b"authorization", f"Bearer {api_key}".encode())]
        )

    async def post(self, line: BatchLine) -> dict[str, Any]:
        """The output record of `line`; retries while the queue is full (429); raises
        `ServerUnavailable` on a 503."""
        while True:
            response = await self._respond(line)
            self._app.state.server.metrics.count_response(response.status_code)
            if response.status_code == 429:
                await anyio.sleep(RETRY_AFTER_S)
                continue
            if response.status_code == 503:
                raise ServerUnavailable(response.body.decode(errors="replace"))
            try:
                body = json.loads(response.body)
            except json.JSONDecodeError:
                text = response.body.decode(errors="replace")
                body = {"error": {"message": text, "type": "server_error"}}
            return {
                "id": f"batch_req_{uuid.uuid4().hex}",
                "custom_id": line.custom_id,
                "response": {
                    "status_code": response.status_code,
                    "request_id": f"req_{uuid.uuid4().hex}",
                    "body": body,
                },
                "error": None,
            }

    async def _respond(self, line: BatchLine) -> Response:
        endpoint, model = self._routes[line.url]
        request = Request(
            {
                "type": "http",
                "method": "POST",
                "scheme": "http",
                "server": ("agentrt.batch", 80),
                "path": line.url,
                "root_path": "",
                "query_string": b"",
                "headers": self._headers,
                "app": self._app,
            },
            _never_disconnects,
        )
        try:
            try:
                body = model.model_validate(line.body)
            except ValidationError as exc:  # FastAPI's errors: each located under "body"
                errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
                raise RequestValidationError(errors, body=line.body) from None
            return await endpoint(body=body, request=request)
        except Exception as exc:
            handlers = self._app.exception_handlers
            cls = next(c for c in type(exc).__mro__ if c in handlers)  # `Exception` is one
            return await handlers[cls](request, exc)


def _post_route(app: FastAPI, url: str) -> tuple[Any, type[BaseModel]]:
    """The endpoint of `app`'s POST route `url` and the model of its body."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path == url and "POST" in route.methods:
            return route.endpoint, route.body_field.field_info.annotation
    raise LookupError(f"the app has no POST route {url}")


async def _never_disconnects() -> dict[str, Any]:
    """The `receive` of a batch line's request: its caller never goes away (a cancelled
    batch cancels the line's task instead)."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def run_lines(
    dispatcher: AppDispatcher,
    lines: Iterable[BatchLine],
    limiter: anyio.Semaphore,
    on_record: Callable[[dict[str, Any]], None],
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Run `lines` with at most `limiter`'s count in flight, calling `on_record` with each
    output record as it finishes. Stops admitting once `should_stop()`; returns when the
    admitted lines are done. Cancelling it aborts the lines in flight (none is recorded).

    The first line is preceded by a one-token copy of itself, so that the prompt prefix the
    lines share (the system prompt, a schema) is computed once and found in the prefix cache
    by every later line, instead of computed by all of the first wave in the same step."""
    lines = iter(lines)
    first = next(lines, None)
    if first is None or should_stop():
        return
    await dispatcher.post(_one_token(first))
    unavailable = False

    async def run(line: BatchLine) -> None:
        nonlocal unavailable
        try:
            on_record(await dispatcher.post(line))
        except ServerUnavailable:
            unavailable = True
            tg.cancel_scope.cancel()
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        for line in itertools.chain([first], lines):
            await limiter.acquire()
            if should_stop() or unavailable:
                limiter.release()
                break
            tg.start_soon(run, line)
    if unavailable:
        raise ServerUnavailable("the server stopped serving")


def _one_token(line: BatchLine) -> BatchLine:
    body = {k: v for k, v in line.body.items() if k not in ("max_tokens", "n")}
    if line.url == "/v1/responses":
        body |= {"max_output_tokens": 1, "store": False}
    else:
        body["max_completion_tokens"] = 1
    return BatchLine(line.custom_id, line.url, body)
