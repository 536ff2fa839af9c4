"""Error bodies shared by the native and the OpenAI routes, so that both answer the same shape:
{"error": {"message", "type", "param", "code"}} with `code` a string named after the status
(OpenAI's own codes, e.g. "model_not_found", win where a route sets one)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 413: "request_too_large",
          429: "too_many_requests", 499: "client_closed_request", 500: "internal_error",
          503: "server_unavailable"}
RETRY_AFTER_S = 1  # what a 429 or a draining 503 tells the client to wait before retrying


class Overloaded(Exception):
    """The server holds as many requests as it may (--max-queued-requests): answer 429."""


class ServerUnavailable(Exception):
    """A child process died or the server is shutting down: answer 503, end streams with an error."""


class InternalAbort(Exception):
    """The scheduler ended a request on an internal error (an abort with a message)."""


def code_for(status: int) -> str:
    return _CODES.get(status, "internal_error" if status >= 500 else "invalid_request")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err_type = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or code_for(status)}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def status_of(e: Exception) -> int:
    """The HTTP status an exception from the tokenizer manager stands for."""
    if isinstance(e, Overloaded):
        return 429
    if isinstance(e, ServerUnavailable):
        return 503
    return 400 if isinstance(e, ValueError) else 500
