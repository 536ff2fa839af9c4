"""Forwarding a request to a worker, with retries and streams relayed event by event.

A request that fails before anything reached the client (no connection, connection lost, a 5xx
answer, or a stream that broke before its first event) is sent again to another healthy worker,
each worker at most once. Once a stream's first event went out, a failure ends the stream with
an error event in the route's own format: `data: {"error": {...}}` then `data: [DONE]` (native
and OpenAI routes, as the server itself ends a failing stream), `event: error` for
/v1/responses. A worker's 4xx is the client's fault: passed through unchanged, never retried.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi.responses import Response

from ..server.errors import error_body, error_response
from ..server.streaming import SSE_DONE, EventStream, sse
from .policy import LeastLoad
from .worker_metrics import RouterMetrics
from .workers import Worker, WorkerPool, describe_error, error_message

logger = logging.getLogger("radixlm.router")

WORKER_HEADER = "X-Radixlm-Worker"  # which worker answered (debugging, tests)
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}
_NOT_RETURNED = _HOP_BY_HOP | {"date", "server"}


def forward_headers(headers: Any) -> dict[str, str]:
    """The client's headers the worker should see (its Authorization among them)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def _returned_headers(resp: httpx.Response, worker: Worker) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in _NOT_RETURNED}
    out[WORKER_HEADER] = worker.url
    return out


def stream_error_event(style: str, message: str, events_sent: int) -> bytes:
    if style == "responses":
        data = {"type": "error", "sequence_number": events_sent, "code": "server_unavailable", "message": message,
                "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    return sse(error_body(503, message)) + SSE_DONE


class Proxy:
    def __init__(self, pool: WorkerPool, policy: LeastLoad, client: httpx.AsyncClient, metrics: RouterMetrics,
                 request_timeout_s: float):
        self.pool = pool
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    def choose(self, key: str | None, tried: set[str], pinned: str | None = None) -> Worker | None:
        candidates = [w for w in self.pool.healthy() if w.url not in tried]
        if not candidates:
            return None
        if pinned is not None:
            for w in candidates:
                if w.url == pinned:
                    return w
        return self.policy.pick(key, candidates)

    def unavailable(self, failures: list[str], tried: set[str], count: bool = True) -> Response:
        """503 naming each worker and why it could not serve (`count`: a refused request, not a
        health probe)."""
        if count:
            self.metrics.no_worker.inc()
        down = [f"{w.url}: {w.reason}" for w in self.pool.workers if not w.healthy and w.url not in tried]
        if failures:
            message = "no worker could serve the request: " + "; ".join(failures + down)
        elif down:
            message = "no healthy workers: " + "; ".join(down)
        else:
            message = "no workers configured"
        return error_response(503, message)

    async def forward(self, method: str, path: str, body: bytes, headers: dict[str, str], params: Any = None,
                      key: str | None = None, pinned: str | None = None, stream_style: str = "sse",
                      remember: Callable[[Worker, bytes], None] | None = None) -> Response:
        """Sends the request to the worker the policy picks (or `pinned` while it is healthy),
        and to the next one while attempts fail before anything reached the client."""
        tried: set[str] = set()
        failures: list[str] = []
        while True:
            worker = self.choose(key, tried, pinned)
            if worker is None:
                return self.unavailable(failures, tried)
            if tried:
                self.metrics.retries.inc()
            tried.add(worker.url)
            self.policy.on_dispatch(key, worker)
            outcome = await self._attempt(worker, method, path, body, headers, params, stream_style, remember)
            if isinstance(outcome, Response):
                return outcome
            logger.warning("%s %s failed on %s: %s", method, path, worker.url, outcome)
            failures.append(f"{worker.url}: {outcome}")

    def _acquire(self, worker: Worker) -> None:
        worker.in_flight += 1
        worker.requests += 1
        self.metrics.requests.labels(worker=worker.url).inc()
        self.metrics.in_flight.labels(worker=worker.url).set(worker.in_flight)

    def _release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self.metrics.in_flight.labels(worker=worker.url).set(worker.in_flight)

    def _lost(self, worker: Worker, e: httpx.TransportError) -> str:
        reason = describe_error(e, self.request_timeout_s)
        if not isinstance(e, httpx.TimeoutException) or isinstance(e, httpx.ConnectTimeout):
            self.pool.mark_down(worker, reason)  # a slow answer is not a dead worker; health checks decide
        return reason

    async def _attempt(self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str],
                       params: Any, stream_style: str, remember: Callable[[Worker, bytes], None] | None
                       ) -> Response | str:
        """The worker's answer as a Response, or why it failed (a string) before anything
        reached the client."""
        self._acquire(worker)
        resp = None
        handed_off = False  # the stream relay releases the worker and closes the response
        try:
            request = self.client.build_request(method, worker.url + path, content=body, headers=headers,
                                                params=params)
            resp = await self.client.send(request, stream=True)
            if resp.status_code >= 500:
                return f"HTTP {resp.status_code}: {error_message(await resp.aread())}"
            if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = resp.aiter_bytes()
                first = await _first_events(chunks)
                if remember is not None:
                    remember(worker, first)
                handed_off = True
                return EventStream(self._relay(worker, resp, chunks, first, stream_style),
                                   headers=_returned_headers(resp, worker))
            content = await resp.aread()
            if remember is not None and resp.status_code == 200:
                remember(worker, content)
            return Response(content, status_code=resp.status_code, headers=_returned_headers(resp, worker))
        except httpx.TransportError as e:
            return self._lost(worker, e)
        finally:
            if not handed_off:
                if resp is not None:
                    await resp.aclose()
                self._release(worker)

    async def _relay(self, worker: Worker, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                     style: str) -> AsyncIterator[bytes]:
        """The worker's stream, whole events at a time, so that an error event never lands inside
        a half-sent one."""
        buffer, events = first, 0
        try:
            while True:
                complete, sep, buffer = buffer.rpartition(b"\n\n")
                if sep:
                    events += complete.count(b"\n\n") + 1
                    yield complete + sep
                try:
                    buffer += await chunks.__anext__()
                except StopAsyncIteration:
                    break
            if buffer.strip():
                yield buffer
        except httpx.TransportError as e:
            reason = self._lost(worker, e)
            self.metrics.stream_errors.inc()
            logger.warning("stream from %s broke after %d events: %s", worker.url, events, reason)
            yield stream_error_event(style, f"worker {worker.url} failed mid-stream: {reason}", events)
        finally:
            await resp.aclose()
            self._release(worker)


async def _first_events(chunks: AsyncIterator[bytes]) -> bytes:
    """Reads until at least one whole event arrived (or the stream ended)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\n\n" in buffer:
            break
    return buffer
