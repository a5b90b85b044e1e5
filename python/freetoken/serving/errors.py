"""Every error the server answers, in OpenAI's shape `{"error": {message, type, param, code}}`
(and Anthropic's, for its Messages API).

Handlers and the requests' own checks (protocol.py) raise `RequestError`; the engine and the
frontend report failures as an error code on a reply (`reply_error` maps it to a status).
`install` makes FastAPI's own failures (unknown route, wrong method, unparsable or oversized
body, schema errors) take the same shape, so no client ever sees `{"detail": ...}` or a
plain-text 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from fastapi import HTTPException as FastAPIHTTPException
from starlette.exceptions import HTTPException

log = logging.getLogger("freetoken")

ENGINE_DEAD = "The engine process has stopped"
SHUTTING_DOWN = "The server is shutting down"

# Error codes that are the server's state or fault, not the request's; every other code is a 400.
_STATUS_OF_CODE = {"engine_dead": 503, "shutdown": 503, "engine_error": 500}


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def reply_error(message: str, code: str | None) -> RequestError:
    """The `RequestError` for an error reply (`UserReply.error`, `.error_code`)."""
    return RequestError(message, code=code, status=_STATUS_OF_CODE.get(code or "", 400))


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a request (a model name, say)
    cannot be encoded as UTF-8 and must not turn an error into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(exc: RequestError) -> dict:
    err_type = {401: "authentication_error", 404: "not_found_error"}.get(
        exc.status, "invalid_request_error" if exc.status < 500 else "server_error")
    return {"error": {"message": exc.message, "type": err_type, "param": exc.param, "code": exc.code}}


def error_from(exc: RequestError) -> JSONResponse:
    return AsciiJSONResponse(error_body(exc), status_code=exc.status)


_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(exc: RequestError) -> dict:
    """Anthropic's shape, for /v1/messages: `{"type": "error", "error": {type, message}}`."""
    err_type = _ANTHROPIC_TYPES.get(exc.status,
                                    "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": err_type, "message": exc.message}}


def anthropic_error(exc: RequestError) -> JSONResponse:
    return AsciiJSONResponse(anthropic_body(exc), status_code=exc.status)


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return error_from(RequestError(message, param=param, code=code, status=status))


def validation_error(exc: RequestValidationError | ValidationError,
                     content_type: str = "application/json") -> RequestError:
    """The `RequestError` for a body that failed its schema or a request's own checks. The
    checks raise `RequestError` inside the request's validator; pydantic keeps it in `ctx`."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    refusal = first.get("ctx", {}).get("error")
    if isinstance(refusal, RequestError):
        return refusal
    if first.get("type") == "json_invalid":
        return RequestError(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                            .rstrip(": "))
    # Only field names make a `param`; pydantic also puts list indices and byte offsets in `loc`.
    path = [x for x in first.get("loc", ()) if x != "body"]
    names = [str(x) for x in path if isinstance(x, str)]
    loc = ".".join(str(x) for x in path)
    msg = first.get("msg", "invalid request")
    if not path and "json" not in content_type:
        msg = "The request body must be a JSON object sent with Content-Type: application/json"
    return RequestError(f"{loc}: {msg}" if loc else msg, param=names[0] if names else None)


class BodyTooLarge(FastAPIHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than {limit} bytes (--max-request-bytes)")


class BodyLimit:
    """ASGI wrapper refusing bodies over `limit()` bytes with a 413 before they are held whole:
    by Content-Length at once, and by counting for chunked bodies."""

    def __init__(self, app, limit: Callable[[], int]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        length = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            exc = BodyTooLarge(limit) if length.isdigit() else HTTPException(400, "Invalid Content-Length")
            response = error_response(exc.detail, exc.status_code)
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)  # FastAPI passes HTTPExceptions raised here through
            return message

        await self.app(scope, counted, send)


def install(app: FastAPI) -> None:
    """Route FastAPI's and Starlette's own errors, and anything unexpected, to OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_from(validation_error(exc, request.headers.get("content-type", "")))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(RequestError)
    async def _request(request: Request, exc: RequestError):
        return error_from(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("Unhandled error on %s", request.url.path)
        return error_response(f"Internal error: {type(exc).__name__}", 500, code="internal_error")
