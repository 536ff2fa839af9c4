"""The checks every HTTP request passes before a handler sees it, as a plain ASGI middleware
(Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers, which abort
requests on them): the API key, the body size, and admission of generation requests (503 while
the server is not serving, 429 when it holds as many requests as it may)."""

from __future__ import annotations

import collections
import math
import secrets
import time
from typing import Any

from .errors import error_response

OPEN_PATHS = {"/health"}  # reachable without the API key (load balancers probe it)
# Routes that start generation: refused with 429 / 503 before their body is even read.
GENERATION_PATHS = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}


class _BodyTooLarge(Exception):
    pass


async def run_with_body_cap(app: Any, scope: Any, receive: Any, send: Any, max_bytes: int, refuse: Any) -> None:
    """Runs `app`, refusing with the ASGI app `refuse` (413) once the body passes `max_bytes`
    (a chunked body has no content-length to check first), unless the answer has started.
    `refuse` runs only then (so it may count the refusal)."""
    received = 0
    started = False

    async def counting_receive() -> Any:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise _BodyTooLarge()
        return message

    async def tracking_send(message: Any) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, counting_receive, tracking_send)
    except _BodyTooLarge:
        if not started:
            await refuse(scope, receive, send)


def bearer_token(authorization: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header; the scheme is case-insensitive
    (RFC 9110), so `bearer` is accepted as clients send it."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class RateLimiter:
    """At most `per_minute` generation requests per client in any 60 s window. A client is the
    Authorization header it sends (its API key), or without one its address; so with --api-key
    every holder of the key shares one budget."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._seen: dict[bytes, collections.deque] = {}

    def wait_s(self, client: bytes, now: float | None = None) -> float:
        """0 when the request may go (and counts it), else seconds until it may."""
        now = time.monotonic() if now is None else now
        times = self._seen.setdefault(client, collections.deque())
        while times and now - times[0] >= self.WINDOW_S:
            times.popleft()
        if len(times) >= self.per_minute:
            return self.WINDOW_S - (now - times[0])
        times.append(now)
        if len(self._seen) > 10_000:  # forget idle clients rather than grow without bound
            self._seen = {k: v for k, v in self._seen.items() if v and now - v[-1] < self.WINDOW_S}
        return 0.0


class Guard:
    """`state` is the app's ServerState: its tokenizer manager (fullness), health and draining
    flags, and metrics (rejections are counted by reason)."""

    def __init__(self, app: Any, state: Any, api_key: str | None, max_request_bytes: int,
                 rate_limit_rpm: int = 0):
        self.app = app
        self.state = state
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.limiter = RateLimiter(rate_limit_rpm) if rate_limit_rpm > 0 else None

    def _refuse(self, reason: str, status: int, message: str, retry_after_s: float | None = None) -> Any:
        """The refusal's response; counts it, so call it only to refuse."""
        self.state.tm.metrics.on_rejected(reason)
        response = error_response(status, message)
        if retry_after_s is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
        return response

    def _body_too_large(self) -> Any:
        return self._refuse("body_too_large", 413, f"request body over {self.max_bytes} bytes (--max-request-bytes)")

    async def _refuse_body_too_large(self, scope: Any, receive: Any, send: Any) -> None:
        """The 413 as an ASGI app, built (and counted) only when a body is refused."""
        await self._body_too_large()(scope, receive, send)

    def _check(self, scope: Any, headers: dict[bytes, bytes]) -> Any:
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return self._body_too_large()
        if self.api_key and scope["path"] not in OPEN_PATHS:
            token = bearer_token(headers.get(b"authorization", b""))
            if token is None or not secrets.compare_digest(token, self.api_key):
                return self._refuse("unauthorized", 401, "missing or wrong API key (Authorization: Bearer <key>)")
        if scope["method"] in ("POST", "PUT") and scope["path"] in GENERATION_PATHS:
            state = self.state
            if not state.serving:
                return self._refuse("unavailable", 503, f"not serving: {state.not_serving_reason}")
            if self.limiter is not None:
                client = headers.get(b"authorization") or str((scope.get("client") or ("",))[0]).encode()
                wait = self.limiter.wait_s(client)
                if wait > 0:
                    return self._refuse("rate_limited", 429, f"more than {self.limiter.per_minute} requests in a "
                                        "minute (--rate-limit-rpm); retry later", wait)
            if state.tm.is_full():
                return self._refuse("queue_full", 429, "the server holds as many requests as it may "
                                    "(--max-queued-requests); retry later")
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check(scope, dict(scope["headers"]))
        if refusal is not None:
            return await refusal(scope, receive, send)
        await run_with_body_cap(self.app, scope, receive, send, self.max_bytes, self._refuse_body_too_large)
