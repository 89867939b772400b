"""OpenAI-style errors: one exception type, one body shape, one middleware that maps every
failure to it. Bad input is a 4xx; only a real fault is a 500, and the server keeps serving."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson
from aiohttp import web

from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger("kvserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_JSON_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_]+)")  # "in": a bad dict key
_MISSING = re.compile(r"^Object missing required field `([A-Za-z_]+)`$")
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's `{"error": {...}}` object."""
        return {"error": {"message": self.message,
                          "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        """The JSON response carrying this error."""
        return web.Response(status=self.status, body=orjson.dumps(self.body()),
                            content_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for invalid input."""
    return APIError(400, message, param)


def invalid_json(exc: msgspec.DecodeError, what: str) -> APIError:
    """A 400 for JSON that does not parse, naming the field when the parser knows it (NaN)."""
    match = _JSON_PATH.search(str(exc))
    return bad_request(f"{what} is not valid JSON: {exc}", match.group(1) if match else None)


def from_exception(exc: BaseException) -> APIError:
    """Maps any exception raised while handling a request to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        match = _JSON_PATH.search(str(exc)) or _MISSING.match(str(exc))
        return bad_request(str(exc), match.group(1) if match else None)
    if isinstance(exc, msgspec.DecodeError):
        return invalid_json(exc, "the request body")
    if isinstance(exc, RecursionError):  # a safety net: decode() reports deep nesting itself
        return bad_request("the request is nested too deeply")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, web.HTTPException):
        return _from_http_exception(exc)
    # Anything else is a bug (an internal invariant failed), never the client's fault.
    logger.exception("unexpected error while handling a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                    code="internal_error")


def _from_http_exception(exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, "no route matches this path; see /v1/models, /v1/completions, "
                             "/v1/chat/completions, /v1/ws", code="not_found")
    if exc.status == 405:
        return APIError(405, f"method not allowed: {exc.reason}", code="method_not_allowed")
    if exc.status == 413:
        return APIError(413, f"the request body is too large: {exc.text}",
                        code="request_too_large")
    if exc.status == 400:  # aiohttp's own, e.g. a body whose bytes do not match its headers
        return APIError(400, f"bad request: {exc.text or exc.reason}")
    return APIError(exc.status, exc.reason or "HTTP error")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into an OpenAI error body; a streaming response that already
    started handles its own errors in-stream."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).response()
    except Exception as exc:
        return from_exception(exc).response()
