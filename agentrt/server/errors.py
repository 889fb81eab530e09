"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the status that
says who is at fault. Client input gets 4xx; 500/503 are kept for real engine faults.

`APIError` is what the server's own code raises; the handlers installed by
`install_error_handlers` turn it, the engine's typed errors and FastAPI's validation errors
into that object, so no route formats an error by hand.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrt.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from agentrt.errors import SchemaError

logger = logging.getLogger("agentrt.server")

# Seconds a client should wait after a 429 before retrying.
RETRY_AFTER_S = 1


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_request(exc: InvalidRequestError, param_names: dict[str, str] | None = None):
    """An engine `InvalidRequestError` as a 400; `param_names` maps engine field names to the
    request's (the engine says `max_tokens` where the client sent `max_completion_tokens`)."""
    param = exc.field
    if param is not None and param_names:
        param = param_names.get(param, param)
    return bad_request(str(exc), param=param)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return invalid_request(exc)
    if isinstance(exc, SchemaError):
        return bad_request(str(exc), code="invalid_schema")
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            str(exc),
            type="requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", type="server_error", code="internal_error")


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
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}{first.get('msg')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    # Exception covers the rest: a bug still answers with an error object (500), not text.
    for cls in (
        InvalidRequestError,
        SchemaError,
        EngineOverloadedError,
        EngineDeadError,
        Exception,
    ):

        @app.exception_handler(cls)
        async def _engine(request: Request, exc: Exception) -> JSONResponse:
            return from_exception(exc).response()
