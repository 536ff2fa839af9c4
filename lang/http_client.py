"""A small JSON/SSE HTTP client on the standard library, so the language needs no HTTP package.

Every failure becomes a BackendError carrying the server's own message (`{"error":
{"message": ...}}` bodies), or saying that the server could not be reached.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterator

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
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and isinstance(event.get("error"), dict):
                    raise BackendError(str(event["error"].get("message", event["error"])))
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
            raw = response.read()
        try:
            return json.loads(raw)
        except ValueError:
            raise BackendError(f"the server answered with non-JSON: {raw[:200]!r}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    raw = e.read()
    try:
        body = json.loads(raw)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body, dict) and body.get("detail"):
            return f"HTTP {e.code}: {body['detail']}"
    except ValueError:
        pass
    text = raw.decode("utf-8", "replace").strip()
    return f"HTTP {e.code}: {text[:500] or e.reason}"
