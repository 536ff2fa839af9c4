"""Small JSON/SSE HTTP clients: HttpClient on the standard library (threads block in it), and
AsyncHttpClient on aiohttp for asyncio programs (one connection pool per event loop; imported
only when an async program runs, so `import radixlm` stays cheap).

Every failure becomes a BackendError carrying the server's own message (`{"error":
{"message": ...}}` bodies), or saying that the server could not be reached.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from typing import Any, AsyncIterator, Iterator

from .backend import BackendError

DEFAULT_TIMEOUT_S = 600.0


class HttpStatusError(BackendError):
    """The server answered with an HTTP error status (kept, so a caller can tell a route the
    server lacks, 404, from a request it refused)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def get(self, path: str) -> Any:
        return self._json(self._open("GET", path, None))

    def post(self, path: str, body: Any) -> Any:
        return self._json(self._open("POST", path, body))

    def post_text(self, path: str, body: Any = None) -> str:
        with self._open("POST", path, body) as response:
            return response.read().decode("utf-8", "replace")

    def post_sse(self, path: str, body: Any) -> Iterator[Any]:
        """Yields each `data: {...}` event's JSON until `data: [DONE]` or the end of the stream;
        an event that is an error object raises BackendError."""
        response = self._open("POST", path, body)
        with response:
            for raw in response:
                event = _sse_event(raw.decode("utf-8"))
                if event is _DONE:
                    return
                if event is not None:
                    yield event

    def _open(self, method: str, path: str, body: Any) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise HttpStatusError(_error_message(e), e.code) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise BackendError(f"cannot reach the server at {self.base_url}: {reason}") from None

    @staticmethod
    def _json(response: Any) -> Any:
        with response:
            return _json_of(response.read())


# Async programs run hundreds of requests at once; each holds a connection while it waits.
_MAX_CONNECTIONS = 1024


class AsyncHttpClient:
    """The asyncio twin of HttpClient: same paths, bodies and errors. A cancelled call closes
    its connection, which the server takes as the client leaving: it aborts the request.

    On aiohttp: httpx's pool (httpcore 1.0) scans every connection for every request, so at
    256 concurrent programs this client spent 9x the CPU of the thread-pool runner's urllib
    (benchmarks/bench_agents.py --part runner)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._session: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._holder: Any = None  # the async generator that closes the pool with its loop

    async def _pool(self) -> Any:
        # A pool belongs to the loop it was made on (asyncio.run() makes a new loop each time)
        # and is closed when that loop shuts down: the loop closes the async generators begun
        # in it (shutdown_asyncgens), and one of them holds the pool.
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=_MAX_CONNECTIONS, ttl_dns_cache=None)
            self._session = aiohttp.ClientSession(self.base_url, headers=self.headers, connector=connector,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._loop = loop
            self._holder = _closed_with_loop(self._session)
            await self._holder.__anext__()
        return self._session

    async def get(self, path: str) -> Any:
        return _json_of(await self._send("GET", path, None))

    async def post(self, path: str, body: Any) -> Any:
        return _json_of(await self._send("POST", path, body))

    async def post_sse(self, path: str, body: Any) -> AsyncIterator[Any]:
        import aiohttp

        try:
            async with (await self._pool()).post(path, json=body) as response:
                if response.status >= 400:
                    raise HttpStatusError(_message_of(response.status, await response.read()), response.status)
                async for raw in response.content:
                    event = _sse_event(raw.decode("utf-8"))
                    if event is _DONE:
                        return
                    if event is not None:
                        yield event
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise BackendError(f"cannot reach the server at {self.base_url}: {e!r}") from None

    async def _send(self, method: str, path: str, body: Any) -> bytes:
        import aiohttp

        try:
            async with (await self._pool()).request(method, path, json=body) as response:
                content = await response.read()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise BackendError(f"cannot reach the server at {self.base_url}: {e!r}") from None
        if response.status >= 400:
            raise HttpStatusError(_message_of(response.status, content), response.status)
        return content

    async def aclose(self) -> None:
        """Closes this loop's pool now (otherwise: when the loop shuts down)."""
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._holder.aclose()
        self._session = self._loop = self._holder = None


async def _closed_with_loop(session: Any) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await session.close()


_DONE = object()


def _sse_event(line: str) -> Any:
    """A `data: {...}` line's JSON, _DONE for `data: [DONE]`, None for other lines; an event
    that is an error object raises BackendError."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        raise BackendError(str(event["error"].get("message", event["error"])))
    return event


def _json_of(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise BackendError(f"the server answered with non-JSON: {raw[:200]!r}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    return _message_of(e.code, e.read(), e.reason)


def _message_of(status: int, raw: bytes, reason: str = "") -> str:
    try:
        body = json.loads(raw)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body, dict) and body.get("detail"):
            return f"HTTP {status}: {body['detail']}"
    except ValueError:
        pass
    text = raw.decode("utf-8", "replace").strip()
    return f"HTTP {status}: {text[:500] or reason}"
