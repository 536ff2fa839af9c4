"""Server-sent events, shared by the native and the OpenAI streaming routes."""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """SSE response that always closes its body generator, also when the client went away.

    ASGI servers on spec 2.4 report a disconnect only by a failing send, which leaves Starlette's
    body generator open until garbage collection; closing it runs the generator's cleanup, which
    aborts the requests in the scheduler right away. `on_close` runs after it, also when the
    body never started (the client left before the first byte): it frees what the route took
    for the stream before answering (its admitted requests).
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None,
                 **response_kwargs: Any):
        super().__init__(body, **response_kwargs)  # the router passes the worker's headers along
        self._on_close = on_close

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:  # also when that was cut short: a gone client's stream is cancelled
                if self._on_close is not None:
                    await self._on_close()


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
