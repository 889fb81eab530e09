"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the status that
says who is at fault. Client input gets 4xx; 500/503 are kept for real engine faults. Under
Anthropic's Messages API (`/v1/messages...`) the same error is written in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, its type read from the status.

`APIError` is what the server's own code raises; the handlers installed by
`install_error_handlers` turn it, every error with an `ErrorCode` (engine and SDK) and
FastAPI's validation errors into that object, so no route formats an error by hand. Status
and type come from one table, `agentrt.errors.ERROR_KINDS`, which the remote client reads
backwards.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrt.engine.client.outputs import RequestOutput
from agentrt.engine.errors import ContextLengthError, EngineError, ErrorCode
from agentrt.errors import ERROR_KINDS, AgentrtError, code_of

logger = logging.getLogger("agentrt.server")

# Seconds a client should wait after a 429 before retrying.
RETRY_AFTER_S = 1

# Paths answered in Anthropic's error shape, and its error type of each status (a 429 here
# is always a full queue: overloaded; any other 5xx is an api_error).
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_shaped(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape (the Messages API's routes)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error the API reports to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape (what the `anthropic` client reads)."""
        kind = _ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The response for a request to `path` (Anthropic's shape under its routes)."""
        body = self.anthropic_body() if anthropic_shaped(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request the server's own checks refuse (`code`: a finer OpenAI code)."""
    return coded_error(ErrorCode.INVALID_REQUEST, message, param=param, detail=code)


def coded_error(
    code: ErrorCode, message: str, *, param: str | None = None, detail: str | None = None
) -> APIError:
    """The API error for an `ErrorCode` (ERROR_KINDS: status, type); the object's `code` is
    ours, or `detail`, OpenAI's finer code (e.g. "context_length_exceeded")."""
    kind = ERROR_KINDS[code]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if kind.status == 429 else None
    return APIError(
        kind.status, message, type=kind.type, param=param, code=detail or code, headers=headers
    )


def from_exception(exc: BaseException, param_names: dict[str, str] | None = None) -> APIError:
    """The API error for an exception raised while serving a request. `param_names` maps the
    engine's field names to the request's (the engine says `max_tokens` where the client sent
    `max_completion_tokens`)."""
    if isinstance(exc, APIError):
        return exc
    code = code_of(exc)
    if code is None or code == ErrorCode.INTERNAL:
        return _internal(exc)
    param = getattr(exc, "field", None)
    if param is not None and param_names:
        param = param_names.get(param, param)
    detail = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    return coded_error(code, str(exc), param=param, detail=detail)


def _internal(exc: BaseException) -> APIError:
    """A 500 for a fault. Its text (a repr, a path, another request's data) goes to the
    server's log only; the client gets an id to report."""
    incident = secrets.token_hex(6)
    logger.error("internal error %s while serving a request", incident, exc_info=exc)
    return coded_error(
        ErrorCode.INTERNAL,
        f"internal error {incident}: the server logged its details; retry, or report the id "
        "if it persists.",
    )


def failed_output(outputs: Sequence[RequestOutput]) -> APIError | None:
    """The API error for the first request the engine ended with finish_reason "error" (a
    grammar that does not compile, an output that cannot be valid, a failure in the engine),
    by its `error_code`; None when every request finished."""
    for output in outputs:
        if output.outputs[0].finish_reason == "error":
            code = output.error_code or ErrorCode.INTERNAL
            if code == ErrorCode.INTERNAL:
                return _internal(RuntimeError(output.error or "the request failed in the engine"))
            return coded_error(code, output.error or "the request failed in the engine")
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid.", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}", ".".join(loc) or None
    # A field of several accepted forms (a union) fails once per form, each error under the
    # form's tag ("list[int]", "constrained-str"): the field is the path before the tag.
    field = _field_path(loc)
    param = ".".join(field) or None
    where = f"{param}: " if param else ""
    if len(field) < len(loc):
        prefix = len(field) + 1  # "body" + the field
        forms = [e for e in errors if [str(p) for p in e.get("loc", ())][1:prefix] == field]
        messages = "; ".join(sorted({str(e.get("msg", "")) for e in forms}))
        return f"{where}matches none of the accepted forms ({messages})", param
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}{first.get('msg')}{more}", param


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")


def _field_path(loc: list[str]) -> list[str]:
    """`loc` up to its first part that is neither a field name nor an index (a union tag)."""
    for i, part in enumerate(loc):
        if not _NAME.fullmatch(part):
            return loc[:i]
    return loc


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param=param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response(request.url.path)

    # Errors with a code, and the rest: a bug still answers with an error object (500).
    for cls in (EngineError, AgentrtError, Exception):

        @app.exception_handler(cls)
        async def _engine(request: Request, exc: Exception) -> JSONResponse:
            return from_exception(exc).response(request.url.path)
